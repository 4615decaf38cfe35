"""Fits the ``cuda_ws`` tile rule's weights (``kernels/sparse24_ws_rule.py``, ``RuleWeights``) to measured tile tables.

Each table (``bench/results/sparse24-ws-tiles-<gpu>.json``, from ``bench/sparse24_wg_tiles.py --kernel ws``, or a
small-n table from ``bench/sparse24_small_n.py``, whose ``cuda_ws`` tiles alone it reads) has, per (M, K, n), the
times of the candidates it ran (``--top`` tables: a few).  For a set of weights the rule picks, per problem, the
least-cost candidate of its whole space (without x multicast where it does not pay), with the rule's two steps after
the cost at n <= 16 (docs/design/0063, 0064), as ``ws_config`` does (``pick_from``); where the table did not time
that tile the problem is untimed and says nothing about those weights.  The score is the mean over timed problems of
best time / picked time, over all tables (each table weighs alike), less a penalty for the worst pick.  A coordinate
search over multiplicative steps, from the present weights, that never adds an untimed problem: a step that moves a
pick onto a tile no table timed is a guess, and a sweep showed such guesses lose (docs/design/0040).

Sweeps (``kernelplan bench sparse24 --sweep --json``) add evidence: each timed the rule's tile of its day on 43
shapes x 12 n, so two sweeps under different rules give, where their picks differ, two measured tiles of one problem
(times relative to dense, measured beside each): one more table, of those pairs.

Rule A/Bs (``bench/sparse24_rule_ab.py``) time moves of picks through the sweep's path. ``--guard AB.json`` keeps the
search off weights that move any pick of the shape sets to a tile an A/B timed slower (``ab_losses``): the tables
favoured a refit whose moves lost up to 8% there (docs/design/0058). ``--start ... --ab AB.json`` lists a weight set's
moves and what the A/Bs timed of them.

    python tools/fit_ws_rule.py bench/results/sparse24-ws-tiles-h100.json bench/results/sparse24-ws-tiles-h200.json \
        --sweep <(git show 1c5de79:bench/results/sparse24-sweep-h200.json) \
        --sweep <(git show 25a8ca5:bench/results/sparse24-sweep-h200.json)
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernelplan.bench.shapes import BATCH_SIZES  # noqa: E402
from kernelplan.kernels.sparse24_ws_rule import WEIGHTS, RuleWeights, WsConfig, pick_from, ws_candidates  # noqa: E402

STEPS = (0.5, 0.7, 0.85, 1.18, 1.4, 2.0)
BETWEEN = "--between" in sys.argv  # the rule's space with ws_candidates' between tiles


def problems(path: str):
    data = json.loads(Path(path).read_text())
    sms = data["meta"]["sms"]
    out = []
    for row in data["rows"]:
        # cuda_ws's tiles alone: the small-n tables (sparse24_small_n.py) time cuda_sp's beside them, and a tuning
        # bench's row (sparse24_tile_tuning.py) where cuda_sp's tiles were tuned has none of this rule's.
        times = {c: t for c, t in (row.get("tiles_ms") or {}).items() if c.startswith("WsConfig")}
        if not times:
            continue
        cands = ws_candidates(row["n"], row["m"], row["k"], between=BETWEEN)
        out.append((row["n"], row["m"], row["k"], sms, cands, [times.get(str(c)) for c in cands],
                    min(times.values())))
    return out


def ws_tile(text: str) -> WsConfig:
    """The tile a bench wrote into its JSON as the ``repr`` of a ``WsConfig``."""
    return eval(text, {"WsConfig": WsConfig})


def weights_of(settings: list[str]) -> RuleWeights:
    """``WEIGHTS`` with the ``FIELD=VALUE`` settings given."""
    fields = {f.name for f in dataclasses.fields(RuleWeights)}
    pairs = [s.split("=", 1) for s in settings]
    bad = [s for s, p in zip(settings, pairs) if len(p) != 2 or p[0] not in fields]
    if bad:
        raise SystemExit(f"weights {bad}: each must be FIELD=VALUE with FIELD one of {sorted(fields)}")
    return dataclasses.replace(WEIGHTS, **{f: float(v) for f, v in pairs})


def short_graph_tables(paths: list[str]) -> list[str]:
    """The tables not timed with the sweep's timer (their meta has no ``timer``): the tile bench's before 98d1cf6, and
    the small-n bench's (``timing.graph_rounds``, replays of about 1 ms)."""
    return [p for p in paths if "timer" not in json.loads(Path(p).read_text()).get("meta", {})]


def sweep_pairs(paths: list[str], sms: int = 132):
    """The problems two or more sweeps timed with different tiles: (n, m, k, sms, the rule's space, times / dense
    (None: untimed), best)."""
    seen: dict = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("ws_config") and row.get("cuda_ws_ms"):
                cfg = ws_tile(row["ws_config"])
                seen.setdefault((row["n"], row["m"], row["k"]), {})[cfg] = row["cuda_ws_ms"] / row["dense_ms"]
    out = []
    for (n, m, k), tiles in seen.items():
        if len(tiles) > 1:
            cands = ws_candidates(n, m, k, between=BETWEEN)
            out.append((n, m, k, sms, cands, [tiles.get(c) for c in cands], min(tiles.values())))
    return out


def ab_pairs(paths: list[str]) -> dict:
    """``{(n, M, K): {(tile A, tile B): [B's time over A's, ...]}}`` from rule A/B files
    (``bench/sparse24_rule_ab.py``): each row's two tiles, timed in one process through the sweep's path.  Files from
    before b65be27 timed, past a shape's first n, that n's tile again (docs/design/0057): give none of those."""
    out: dict = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            here, other = ws_tile(row["here"]), ws_tile(row["other"])
            at = out.setdefault((row["n"], row["m"], row["k"]), {})
            at.setdefault((here, other), []).append(row["other_us"] / row["here_us"])
            at.setdefault((other, here), []).append(row["here_us"] / row["other_us"])
    return out


def moved_picks(shapes, batch, other, sms: int = 132, gpu=None) -> list[tuple]:
    """``(n, M, K, the rule's tile, other(n, M, K))`` over ``shapes`` at ``batch`` where ``cuda_ws`` runs (Hopper,
    bf16) and the two tiles differ; ``gpu``: the rule's GPU facts (``kernels.gpu_facts``; None, the model's)."""
    from kernelplan.kernels.sparse24_ws_rule import ws_config
    from kernelplan.sparse24.dispatch import backend_for

    out = []
    for m, k in shapes:
        for n in batch:
            if backend_for((9, 0), n, m, k, "bf16") == "cuda_ws":
                present, new = ws_config(n, m, k, sms, gpu=gpu), other(n, m, k)
                if present != new:
                    out.append((n, m, k, present, new))
    return out


def timed_moves(w: RuleWeights, pairs: dict, shapes, batch, sms: int = 132) -> list[tuple[tuple, float | None]]:
    """Each pick ``w`` moves from the present weights' (``moved_picks``) with the A/B's time of the new pick over the
    present one's where a row timed that pair (the median of rows), else None."""
    from kernelplan.kernels.sparse24_ws_rule import ws_config

    out = []
    for move in moved_picks(shapes, batch, lambda n, m, k: ws_config.__wrapped__(n, m, k, sms, w=w), sms):
        got = pairs.get(move[:3], {}).get(move[3:])
        out.append((move, statistics.median(got) if got else None))
    return out


def ab_moves(w: RuleWeights, pairs: dict, shapes, batch, sms: int = 132) -> tuple[list[float], list[tuple]]:
    """The picks ``w`` moves (``timed_moves``): the A/B's times of those a row timed, and the moves none timed."""
    moves = timed_moves(w, pairs, shapes, batch, sms)
    return [r for _, r in moves if r is not None], [move for move, r in moves if r is None]


def ratios(w: RuleWeights, table, unicast: bool = False, waves: float = math.inf,
           cms: tuple[int, ...] = (2, 4)) -> list[float | None]:
    """Per problem, the best time over the rule's pick's (None where the table did not time the pick).
    ``unicast``: each pick that still multicasts x without splitting K (cm in ``cms``, kc = 1) in a grid of at most
    ``waves`` waves of CTAs moved to the same tile with cm = 1, where the table timed it: what the rule would gain by
    not multicasting there too (docs/design/0039, 0053, 0054)."""
    out = []
    for n, m, k, sms, cands, times, best in table:
        pick = pick_from(cands, n, m, k, sms, w)
        if unicast and pick.kc == 1 and pick.cm in cms and math.prod(pick.grid(n, m)) <= waves * sms:
            one = dataclasses.replace(pick, cm=1)
            pick = one if one in cands and times[cands.index(one)] is not None else pick
        t = times[cands.index(pick)] if pick in cands else None
        out.append(None if t is None else best / t)
    return out


def timed(w: RuleWeights, table, unicast: bool = False, **where) -> list[float]:
    return [r for r in ratios(w, table, unicast, **where) if r is not None]


def untimed(w: RuleWeights, tables) -> int:
    """How many problems, over all tables, whose pick under ``w`` the table did not time."""
    return sum(r is None for t in tables for r in ratios(w, t))


def report(w: RuleWeights, table) -> list[str]:
    """The rule's picks against the best tile timed, by n: the mean and largest ratio of their times and how many
    problems it misses by more than 5%; the three largest misses; and x multicast (cm > 1, K not split) against the
    same tile without it, over every pair the table timed (docs/design/0039)."""
    rs = ratios(w, table)
    misses = [(1 / r, n, m, k) for r, (n, m, k, *_) in zip(rs, table) if r is not None]
    lines = [f"untimed picks: {sum(r is None for r in rs)} of {len(rs)}"] if None in rs else []
    lines.append("n | mean | max | over 5%")
    for n in sorted({n for _, n, _, _ in misses}):
        at = [x for x, nn, _, _ in misses if nn == n]
        lines.append(f"{n} | {statistics.mean(at):.3f} | {max(at):.3f} | {sum(x > 1.05 for x in at)}")
    lines += [f"miss {x:.3f}: {m}x{k} n = {n}" for x, n, m, k in sorted(misses, reverse=True)[:3]]
    pairs = []  # (waves of the grid, the multicast tile, its time over the same tile's without multicast)
    for n, m, _, sms, cands, times, _ in table:
        at = {c: t for c, t in zip(cands, times) if t is not None}
        pairs += [(math.prod(c.grid(n, m)) / sms, c, t / at[c1]) for c, t in at.items()
                  if c.kc == 1 and c.cm > 1 and (c1 := dataclasses.replace(c, cm=1)) in at]
    if pairs:
        ratios_ = [r for _, _, r in pairs]
        lines.append(f"x multicast, kc = 1: {len(pairs)} pairs, the tile without it faster in "
                     f"{100 * sum(r > 1 for r in ratios_) / len(pairs):.0f}%, multicast's time over it median "
                     f"{statistics.median(ratios_):.3f}")
        for cm in (2, 4):  # by the grid's waves: multicast_pays' MULTICAST_MIN_WAVES (docs/design/0054)
            for lo, hi in ((0, 2), (2, 4), (4, 8), (8, 16), (16, math.inf)):
                at = [r for w, c, r in pairs if lo < w <= hi and c.cm == cm]
                if at:
                    lines.append(f"  cm = {cm}, grids of {lo}-{hi:g} waves: {len(at)} pairs, median "
                                 f"{statistics.median(at):.3f}, min {min(at):.3f}, max {max(at):.3f}")
    return lines


def held(ns: list[int], sms: int = 132):
    """The sweep set's problems at ``ns`` with the present pick alone timed: in ``untimed``'s count, a search that
    moves any of those picks adds an untimed problem, so it keeps the rule where no table timed its tiles."""
    from kernelplan.bench.sweep import sweep_shapes

    out = []
    for m, k in sweep_shapes():
        for n in ns:
            cands = ws_candidates(n, m, k, between=BETWEEN)
            pick = pick_from(cands, n, m, k, sms)
            out.append((n, m, k, sms, cands, [1.0 if c == pick else None for c in cands], 1.0))
    return out


# A move an A/B timed at more than this much of the present pick's time is a loss the search does not take (--guard):
# A/B medians of the same pair read within 2% of each other (docs/design/0056).
GUARD_TOL = 0.02


def ab_losses(w: RuleWeights, pairs: dict, batch, sms: int = 132) -> list[tuple]:
    """The picks ``w`` moves from the present weights', over every shape set at ``batch``, whose move an A/B timed
    slower than the present pick by more than ``GUARD_TOL`` (the median of its rows): ``(n, M, K, present, new,
    new's time over present's)``."""
    from kernelplan.bench.sweep import SHAPE_SETS

    return [(*move, r) for shapes in SHAPE_SETS.values() for move, r in timed_moves(w, pairs, shapes(), batch, sms)
            if r is not None and r > 1 + GUARD_TOL]


def score(w: RuleWeights, tables) -> float:
    rs = [r for r in (timed(w, t) for t in tables) if r]
    return statistics.mean(statistics.mean(r) for r in rs) + 0.1 * min(min(r) for r in rs)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--sweep", action="append", default=[])
    ap.add_argument("--between", action="store_true", help="fit the rule over the space with between tiles")
    ap.add_argument("--unicast", action="store_true",
                    help="only print each table's picks with and without x multicast where K is not split")
    ap.add_argument("--unicast-waves", type=float, default=math.inf, metavar="W",
                    help="with --unicast: only in grids of at most W waves of CTAs")
    ap.add_argument("--unicast-cm", type=int, action="append", default=[], metavar="CM",
                    help="with --unicast: only picks that multicast x to this many CTAs (repeatable; default: 2, 4)")
    ap.add_argument("--report", action="store_true",
                    help="only print each table's misses by n and its x multicast pairs, at the present weights "
                         "(or --start's)")
    ap.add_argument("--field", action="append", default=[], choices=[f.name for f in dataclasses.fields(RuleWeights)],
                    help="search only this weight (repeatable; default: all)")
    ap.add_argument("--start", action="append", default=[], metavar="FIELD=VALUE",
                    help="start the search from this weight (a weight at 0 is not moved by the search's factors)")
    ap.add_argument("--hold", type=int, nargs="*", default=[], metavar="N",
                    help="keep the present picks over the sweep set at these n (those the tables did not time)")
    ap.add_argument("--ab", action="append", default=[], metavar="AB.json",
                    help="only print, per shape set, the picks --start's weights move from the present ones and each "
                         "move's time over the present pick's where these rule A/B files timed that pair")
    ap.add_argument("--guard", action="append", default=[], metavar="AB.json",
                    help="the search takes no weights that move a pick of a shape set to a tile these rule A/B files "
                         "timed slower than the present pick (by more than GUARD_TOL)")
    a = ap.parse_args(argv)
    paths = a.tables + (["sweep pairs"] if a.sweep else [])
    for path in short_graph_tables(a.tables):
        print(f"note: {path} was timed with short graphs (no meta.timer: the tile bench before 98d1cf6, or the small-n "
              f"bench), which read K-split tiles 7% slow and x multicast 2% against the sweep's timer "
              f"(docs/design/0056)", file=sys.stderr)
    tables = [problems(p) for p in a.tables] + ([sweep_pairs(a.sweep)] if a.sweep else [])
    w = weights_of(a.start)
    if a.unicast:
        for p, t in zip(paths, tables):
            r, u = timed(w, t), timed(w, t, unicast=True, waves=a.unicast_waves, cms=tuple(a.unicast_cm or (2, 4)))
            print(f"{p} ({len(t)} problems): mean {statistics.mean(r):.4f} min {min(r):.3f}; without multicast "
                  f"where kc = 1: mean {statistics.mean(u):.4f} min {min(u):.3f}")
        return 0
    if a.ab:
        from kernelplan.bench.sweep import SHAPE_SETS

        pairs = ab_pairs(a.ab)
        for name, shapes in SHAPE_SETS.items():
            times, guesses = ab_moves(w, pairs, shapes(), BATCH_SIZES)
            summary = (f"median {statistics.median(times):.3f}, max {max(times):.3f}, faster in "
                       f"{sum(r < 1 for r in times)}" if times else "none timed")
            print(f"{name}: {len(times) + len(guesses)} picks move; {len(times)} timed in the A/B, new "
                  f"over present: {summary}; {len(guesses)} untimed")
            for n, m, k, present, new in guesses:
                print(f"  untimed: {m}x{k} n = {n}: {present} -> {new}")
        return 0
    if a.report:
        for p, t in zip(paths, tables):
            print(f"{p} ({len(t)} problems): the rule's pick's time over the best timed")
            print("\n".join("  " + line for line in report(w, t)))
        return 0
    kept = [held(a.hold)] if a.hold else []  # counted as untimed where a pick moves, never scored
    guard = ab_pairs(a.guard) if a.guard else {}
    best, gaps = score(w, tables), untimed(w, tables + kept)
    improved = True
    while improved:
        improved = False
        for field in a.field or [f.name for f in dataclasses.fields(RuleWeights)]:
            for f in STEPS:
                trial = dataclasses.replace(w, **{field: getattr(w, field) * f})
                if untimed(trial, tables + kept) > gaps:
                    continue
                s = score(trial, tables)
                if s > best + 1e-6 and guard and ab_losses(trial, guard, BATCH_SIZES):
                    continue
                if s > best + 1e-6:
                    w, best, improved = trial, s, True
    for p, t in zip(paths, tables):
        r, r0 = timed(w, t), timed(WEIGHTS, t)
        print(f"{p} ({len(t)} problems, {len(r)} picks timed): mean {statistics.mean(r):.3f} median "
              f"{statistics.median(r):.3f} min {min(r):.3f} "
              f"(present weights: mean {statistics.mean(r0):.3f} over {len(r0)} timed)")
    print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
