"""Reads the small-n tables (``bench/results/sparse24-small-n-<gpu>.json``, from ``bench/sparse24_small_n.py``) for
``cuda_sp``'s tile rule at n <= 16 (``kernels/sparse24_sp.py``: ``SMALL_N_CTAS_PER_SM``, ``SMALL_N_WARPS_PER_SM``)
and the Hopper boundary between ``cuda_sp`` and ``cuda_ws`` (``sparse24/dispatch.py``: ``backend_for``).

Each table row has every ``cuda_sp`` tile's time and ``cuda_ws``'s first 4, timed side by side.  Prints:

* per table, for each (CTAs an SM, warps an SM) of the rule, its pick's time over the best ``cuda_sp`` tile's, as a
  geometric mean and the worst, over the rows where ``cuda_sp``'s best tile beats ``cuda_ws``'s rule by 3% or more
  (where the tile matters); today's setting is marked;
* per table, the boundary of today's ``backend_for`` with today's tiles: its time over the faster of the two rules'
  tiles, and over the choice the table was made under (each row's ``rule`` and ``sp_rule``), geometric means;
* where the table timed both, the pick with K slices that divide K's steps against today's, which may run slices a
  step apart (docs/design/0059).

Docs: docs/design/0042.

    python tools/fit_sp_rule.py bench/results/sparse24-small-n-h100.json bench/results/sparse24-small-n-h200.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernelplan.kernels import sparse24_sp  # noqa: E402
from kernelplan.kernels.sparse24_ws_rule import ws_config  # noqa: E402
from kernelplan.sparse24.dispatch import backend_for  # noqa: E402

CTAS_PER_SM = (1, 2, 4, 8)
WARPS_PER_SM = (8, 12, 16, 24, 32)
MATTERS = 0.97  # a row counts for the tile rule where cuda_sp's best tile takes at most this of cuda_ws's rule's


def geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def _sp_times(row: dict) -> dict:
    return {c: t for c, t in row["tiles_ms"].items() if c.startswith("SpConfig")}


def _timed(sp: dict, cfg) -> float:
    """The time of ``cfg`` in a row's cuda_sp tiles: its own, else that of the one tile of its rows and K slices the
    table timed.  The settings of the grid choose rows and K slices, and each tile's ring is sized by ``_filled``;
    since 0052 it sizes rings for the CTAs an SM holds at once, so on grids past the registers' hold a setting's pick
    can have a deeper ring than the tables (timed before) gave that tile.  KeyError where neither was timed."""
    if str(cfg) in sp:
        return sp[str(cfg)]
    tile = lambda c: (c.n_tiles, c.row_tiles, c.m_warps, c.k_warps)  # noqa: E731
    same = [t for c, t in sp.items() if tile(eval(c, {"SpConfig": sparse24_sp.SpConfig})) == tile(cfg)]
    if len(same) != 1:
        raise KeyError(str(cfg))
    return same[0]


def _dividing(k_warps: int, k: int) -> int:
    while (k // 64) % k_warps:
        k_warps //= 2
    return k_warps


def timed_space():
    """``sp_config`` in the space the tables timed (a context): K slices that divide K's steps, halved until they do.
    Slices a step apart came after the tables (docs/design/0059) and were A/B-timed on their own; here the rule's
    settings are compared on tiles the tables hold."""
    return mock.patch.object(sparse24_sp, "_sliced", _dividing)


def rule_ratios(rows: list[dict], sms: int, ctas: int, warps: int) -> list[float]:
    """The rule's pick over the best ``cuda_sp`` tile, per row where the tile matters, with the rule set to ``ctas``
    and ``warps`` an SM (``_timed``: every tile of the space is timed, at one ring each)."""
    saved = sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM
    sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM = ctas, warps
    out = []
    try:
        with timed_space():
            for row in rows:
                sp = _sp_times(row)
                if min(sp.values()) <= MATTERS * row["tiles_ms"][row["ws_rule"]]:
                    pick = sparse24_sp.sp_config(row["n"], row["m"], row["k"], sms)
                    out.append(_timed(sp, pick) / min(sp.values()))
        return out
    finally:
        sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM = saved


def boundary(rows: list[dict], sms: int) -> tuple[float, float]:
    """Today's backend and tiles (``timed_space``): (time over the faster of the two rules' tiles, time over the
    table's own choice), geometric means over the rows.  A row whose ``cuda_ws`` pick today the table did not time
    (its rule was another then, docs/design/0061) counts only where today's backend is ``cuda_sp``, against the
    table's ``cuda_ws`` tile."""
    best, before = [], []
    for row in rows:
        n, m, k = row["n"], row["m"], row["k"]
        with timed_space():
            pick = sparse24_sp.sp_config(n, m, k, sms)
        then_ws, sp = row["tiles_ms"][row["ws_rule"]], row["tiles_ms"][str(pick)]
        ws = row["tiles_ms"].get(str(ws_config(n, m, k, sms)))
        if backend_for((9, 0), n, m, k, "bf16") == "cuda_sp":
            today = sp
        elif ws is None:
            continue
        else:
            today = ws
        then = row["tiles_ms"][row["sp_rule"]] if row["rule"] == "cuda_sp" else then_ws
        best.append(today / min(ws or then_ws, sp))
        before.append(today / then)
    return geomean(best), geomean(before)


def slice_moves(rows: list[dict], sms: int) -> list[tuple[int, int, int, float]]:
    """(n, M, K, the pick among slices that divide K's steps over today's pick, in time) for each row where the two
    differ and the table timed both: the A/B of slices a step apart (docs/design/0059)."""
    out = []
    for row in rows:
        n, m, k = row["n"], row["m"], row["k"]
        with timed_space():
            before = sparse24_sp.sp_config(n, m, k, sms)
        today = sparse24_sp.sp_config(n, m, k, sms)
        sp = _sp_times(row)
        if today != before and str(today) in sp and str(before) in sp:
            out.append((n, m, k, sp[str(before)] / sp[str(today)]))
    return out


def report(path: str) -> list[str]:
    table = json.loads(Path(path).read_text())
    rows, sms = table["rows"], table["meta"]["sms"]
    lines = [f"{path} ({table['meta']['device']}, {table['meta']['commit']}): cuda_sp's pick / its best tile"]
    today = sparse24_sp.SMALL_N_CTAS_PER_SM, sparse24_sp.SMALL_N_WARPS_PER_SM
    settings = [(c, w) for c in CTAS_PER_SM for w in WARPS_PER_SM]
    if not rule_ratios(rows, sms, *today):  # the rows counted do not depend on the setting
        lines.append(f"  no rows where cuda_sp's best tile beats cuda_ws's rule by {1 - MATTERS:.0%}")
        settings = []
    for ctas, warps in settings:
        ratios = rule_ratios(rows, sms, ctas, warps)
        mark = "  <- today" if (ctas, warps) == today else ""
        lines.append(f"  >= {ctas} CTAs an SM, {warps:2d} warps an SM: {geomean(ratios):.4f} "
                     f"(worst {max(ratios):.3f}, {len(ratios)} rows){mark}")
    best, before = boundary(rows, sms)
    lines.append(f"  today's boundary: {best:.4f} of the faster rule's tile; {before:.4f} of the table's own choice")
    return lines + slice_report(rows, sms)


def slice_report(rows: list[dict], sms: int) -> list[str]:
    moves = slice_moves(rows, sms)
    if not moves:
        return []
    ratios = [r for *_, r in moves]
    return [f"  K slices a step apart: {len(moves)} picks moved; dividing slices' time over today's: median "
            f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
            f"{sum(r < 1 for r in ratios)} slower"] + [f"    n={n:3d} {m}x{k}: {r:.3f}" for n, m, k, r in moves]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for path in argv:
        print("\n".join(report(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
