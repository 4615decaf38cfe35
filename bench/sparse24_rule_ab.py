"""The cuda_ws rule against the same rule with another x-multicast threshold or other weights, through the sweep's own
path.

Every problem of the sweep set (or another shape set, or ``--shapes``) where ``ws_config`` picks another tile than it
would with x multicast without a K split past ``--multicast-min-waves`` waves
(``sparse24_ws_rule.MULTICAST_MIN_WAVES``), or with the cost weights ``--weights`` (``RuleWeights``, fields not named
as they are), or with K split only where the split divides K's steps (``--even-k-split``, the rule before
docs/design/0058), or with the small-n K splits on wide weights alone (``--wide-split-only``, the rule before 0061),
or without the small-n split over 3 (``--no-split3``, before 0063) or the small-grid split (``--no-small-grid-split``,
before 0064), or with the ring at its 8 stages where the rule deepens it (``--no-deep-ring``, before 0066), or without
tiles of 192 rows of W splitting K (``--no-wide-k-splits``, ``sparse24_ws_rule.wide_k_splits``, before 0067), or
without a K split's twin of one block of W and one tile of x (``--no-one-x``, ``sparse24_ws_rule.one_x_twin``, before
0068), or with every tie between a ping-pong tile and the same tile one a CTA to the ping-pong one (``--pp-ties``,
before 0068's ``PP_TIE_MAX_ACC``) or to the tile one a CTA (``--plain-ties``, since 0069's 16-bit staging), or with
the ties where x has more tiles than W has blocks to the ping-pong tile (``--pp-wide-x-ties``, before 0070), or with
a K split of 256 rows of x in one wave kept (``--split-wide-x``, before 0072), is timed
with both tiles as the sweep times the rule's (``bench/sweep.py``: ``MmaLinear`` on the one device layout, each call
on the next of the weight's copies past twice the L2, ``graph_us`` replays), in one process, alternating A B B A,
beside dense ``F.linear``; with ``--eager``, also eagerly, host work included. Each side has its own copies of the
weight, so that each tile's launches are its own, and both rules read the device's own facts
(``gpu_facts.device_facts``). A check of a rule change that the tile tables' timings (``sparse24_wg_tiles.py``) and a
sweep part disagreed on (docs/design/0055).

``--table-misses TABLE`` takes the other side from a tile table instead: at each problem where the table's best tile
ran ``--min-gain`` (3%) or more faster than the rule's, that tile (docs/design/0056).  ``--here-set NAME=VALUE``
gives this side ``sparse24_ws_rule``'s constants so, to time a step past its bounds against the rule without it
(docs/design/0074); the later records' other rules are ``OTHER_RULES``.  Writes
``bench/results/sparse24-rule-ab-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_rule_ab.py \
        --multicast-min-waves 16
    ... python bench/sparse24_rule_ab.py --weights l2=0.0071 pp_tile=5550
    ... python bench/sparse24_rule_ab.py --even-k-split --batch 1 8 16 32 64 --shapes 2048x1600 8192x2880
    ... python bench/sparse24_rule_ab.py --wide-split-only --batch 1 8 16 --shape-set "held-out models"
    ... python bench/sparse24_rule_ab.py --table-misses bench/results/sparse24-ws-top4-graphus-h200.json
    ... python bench/sparse24_rule_ab.py --no-narrow-splits --here-set NARROW_SPLIT_MAX_N=1024 --shapes 256x768
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.shapes import BATCH_SIZES
from kernelplan.bench.sweep import EAGER_CALLS, EAGER_ROUNDS, SHAPE_SETS, _cycling, copies_past_l2
from kernelplan.kernels import sparse24_ws_rule
from kernelplan.kernels.gpu_facts import device_facts
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import (_MAX_STAGES, WEIGHTS, RuleWeights, WsConfig, _deepest, cost_pick,
                                                 pick_from, rule_pick, rule_tail, small_n_splits, wide_split, with_push,
                                                 ws_candidates, ws_config)
from kernelplan.sparse24 import compress, prune
from kernelplan.sparse24.dispatch import wide_weight
from kernelplan.sparse24.layout import pack_reason
from kernelplan.timing import graph_us, host_us_per_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from fit_ws_rule import moved_picks, weights_of, ws_tile  # noqa: E402


class FixedTile(WsKernel):
    """``cuda_ws`` on one tile, whatever the rule would pick.  Named after its tile: a weight keeps its launches
    under its kernel's name (``MmaLinear._key``), and under ``cuda_ws``'s own a weight kept the first FixedTile's tile
    for every later n and every other FixedTile (docs/design/0057)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.name = f"cuda_ws {cfg}"

    def config(self, n, m, k, device, activation=None):
        return self.cfg


def wide_split_pick(n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS, gpu=None) -> WsConfig:
    """The rule before docs/design/0061: at n <= 16 the K-split tile of 32 rows of x (``small_n_splits``) only on a
    wide weight, and there its one-block form whatever it costs; elsewhere the least-cost tile of the rest."""
    splits = small_n_splits(n, k)
    if splits and wide_weight(m, k):
        return with_push(next(c for c in splits if c.wm == 1), n, m, sms, gpu)
    cfg = pick_from([c for c in ws_candidates(n, m, k) if c not in splits], n, m, k, sms, w, small_grids=False,
                    gpu=gpu)  # past n = 16 the rule's own pick
    return rule_tail(cfg, n, m, k, sms, gpu=gpu)


def other_pick(n: int, m: int, k: int, sms: int, waves: float, w: RuleWeights = WEIGHTS, even_split: bool = False,
               wide_split_only: bool = False, no_split3: bool = False, no_small_grid: bool = False,
               no_deep_ring: bool = False, no_wide_splits: bool = False, no_one_x: bool = False,
               pp_ties: bool = False, plain_ties: bool = False, pp_wide_x_ties: bool = False,
               split_wide_x: bool = False, whole_k_min_x_tiles: int | None = None,
               no_one_block_split: bool = False, unicast_ties: bool = False, no_narrow_splits: bool = False,
               no_mid_grid_splits: bool = False, other_set: dict | None = None, gpu=None):
    """``ws_config``'s tile had it ``MULTICAST_MIN_WAVES = waves`` and weights ``w`` (its cache neither read nor
    written); with ``even_split``, among K splits that divide K's steps alone, as the rule was before uneven slices
    (docs/design/0058); with ``wide_split_only``, as it was before the small-n K splits joined the cost
    (``wide_split_pick``); with ``no_split3``, without the small-n K split over 3 CTAs (the rule before
    docs/design/0063); with ``no_small_grid``, without ``small_grid_split`` (before 0064); with ``no_deep_ring``, the
    ring ``_deepest`` gives where ``with_ring`` deepens it (before 0066); with ``no_wide_splits``, without tiles of 192
    rows of W splitting K in its space (before 0067); with ``no_one_x``, without ``one_x_twin`` (before 0068); with
    ``pp_ties``, each tie between a ping-pong tile and the same tile one a CTA to the ping-pong one (before 0068's
    ``PP_TIE_MAX_ACC``); with ``plain_ties``, those ties to the tile one a CTA at every size (``PP_TIE_MAX_ACC`` 0);
    with ``pp_wide_x_ties``, the ties where x has more tiles than W has blocks to the ping-pong tile at every size
    (``PP_TIE_WIDE_X``, before 0070); with ``split_wide_x``, keeping a K split of 256 rows of x in one wave where this
    rule takes the pick with K whole (``sparse24_ws_rule.split_wide_x``, before 0072); with ``whole_k_min_x_tiles``,
    that step from this many tiles of x on (``WHOLE_K_MIN_X_TILES``; 0073 timed 1 and 2); with
    ``no_one_block_split``, keeping a ping-pong tile of one block where this rule takes its K split over 2
    (``one_block_split_of``, before 0073); with ``unicast_ties``, the cost ties between x multicast to 2 CTAs and
    none given to none (``_MCAST_TIE_MIN_BN`` past every tile, 0073); with ``no_narrow_splits``, keeping a ping-pong
    tile of 16-32 rows of x where this rule takes a narrow K split over 2 (``narrow_split_of``, before 0073; timed as
    a candidate at 9c9745f); with ``no_mid_grid_splits``, keeping a pick whose grid runs under a quarter of the SMs
    (a lone ping-pong tile, half) past n = 16 where this rule takes a K split of more CTAs (``mid_grid_split``,
    before 0074; timed as a candidate at 15d0309 and 0ab73e2); with ``other_set``, ``sparse24_ws_rule``'s constants
    so (name -> value).  Each other step of the rule as it is, on the GPU facts ``gpu`` (None: the model's)."""
    present = (sparse24_ws_rule.MULTICAST_MIN_WAVES, sparse24_ws_rule.PP_TIE_MAX_ACC, sparse24_ws_rule.PP_TIE_WIDE_X,
               sparse24_ws_rule.WHOLE_K_MIN_X_TILES, sparse24_ws_rule._MCAST_TIE_MIN_BN)
    sparse24_ws_rule.MULTICAST_MIN_WAVES = waves
    kept = {name: getattr(sparse24_ws_rule, name) for name in other_set or {}}
    for name, value in (other_set or {}).items():
        setattr(sparse24_ws_rule, name, value)
    if unicast_ties:
        sparse24_ws_rule._MCAST_TIE_MIN_BN = 1 << 30
    if whole_k_min_x_tiles is not None:
        sparse24_ws_rule.WHOLE_K_MIN_X_TILES = whole_k_min_x_tiles
    sparse24_ws_rule.PP_TIE_WIDE_X = present[2] or pp_wide_x_ties
    if pp_ties:
        sparse24_ws_rule.PP_TIE_MAX_ACC = 1 << 30
    if plain_ties:
        sparse24_ws_rule.PP_TIE_MAX_ACC = 0
    try:
        cfg = (wide_split_pick if wide_split_only else ws_config.__wrapped__)(n, m, k, sms, w=w, gpu=gpu)

        def finished(cfg):
            return rule_tail(cfg, n, m, k, sms, gpu=gpu)

        if no_small_grid:
            cfg = finished(cost_pick(n, m, k, sms, w=w, gpu=gpu))
        if no_split3 and cfg.kc == 3:
            cfg = finished(rule_pick([c for c in ws_candidates(n, m, k) if c.kc != 3], n, m, k, sms, w, gpu))
        if even_split and (k // 64) % cfg.kc:
            cfg = finished(rule_pick([c for c in ws_candidates(n, m, k) if (k // 64) % c.kc == 0], n, m, k, sms, w,
                                     gpu))
        if no_wide_splits and wide_split(cfg):
            cfg = finished(pick_from([c for c in ws_candidates(n, m, k) if not wide_split(c)], n, m, k, sms, w,
                                     gpu=gpu))
        for off, step in ((no_one_x, "one_x"), (split_wide_x, "whole_k"), (no_one_block_split, "one_block_split"),
                          (no_narrow_splits, "narrow_split"),
                          (no_mid_grid_splits, "mid_grid")):  # pick_from's steps: the rule before each one's record
            if off:
                space = ws_candidates(n, m, k)
                before = pick_from(space, n, m, k, sms, w, gpu=gpu, **{step: False})
                cfg = cfg if before == pick_from(space, n, m, k, sms, w, gpu=gpu) else finished(before)
        if no_deep_ring and cfg.stages > _MAX_STAGES:
            cfg = with_push(_deepest(cfg.bn, cfg.wm, cfg.cm, cfg.kc, cfg.sk, cfg.pp), n, m, sms, gpu)
        return cfg
    finally:
        for name, value in kept.items():
            setattr(sparse24_ws_rule, name, value)
        (sparse24_ws_rule.MULTICAST_MIN_WAVES, sparse24_ws_rule.PP_TIE_MAX_ACC, sparse24_ws_rule.PP_TIE_WIDE_X,
         sparse24_ws_rule.WHOLE_K_MIN_X_TILES, sparse24_ws_rule._MCAST_TIE_MIN_BN) = present


def moved(shapes, batch, sms: int, waves: float, w: RuleWeights = WEIGHTS, gpu=None,
          **other_rule) -> list[tuple[int, int, int]]:
    """(n, M, K) where cuda_ws runs and the rule's tile is not the one it would pick with ``waves``, ``w`` and
    ``other_rule`` (``other_pick``'s keywords)."""
    def other(n, m, k):
        return other_pick(n, m, k, sms, waves, w, gpu=gpu, **other_rule)

    return [move[:3] for move in moved_picks(shapes, batch, other, sms, gpu)]


def table_misses(path: str, sms: int, min_gain: float, gpu=None) -> dict[tuple[int, int, int], WsConfig]:
    """(n, M, K) -> the best tile a tile table (``sparse24_wg_tiles.py --kernel ws``) timed, where it ran at least
    ``min_gain`` faster than the rule's own tile (``ws_config``, timed in the same row)."""
    out = {}
    for row in json.loads(Path(path).read_text())["rows"]:
        times = {t: ms for t, ms in row.get("tiles_ms", {}).items() if t.startswith("WsConfig")}
        rule = str(ws_config(row["n"], row["m"], row["k"], sms, gpu=gpu))
        if rule not in times:
            continue
        best = min(times, key=times.get)
        if times[rule] >= (1 + min_gain) * times[best]:
            out[(row["n"], row["m"], row["k"])] = ws_tile(best)
    return out


# The other rules besides --multicast-min-waves and --weights, each the rule before a record: (flag, other_pick's
# keyword, the flag's help after "the other rule", what the summary line says of it).
OTHER_RULES = (
    ("--even-k-split", "even_split", "splits K over a cluster only where the split divides K's steps",
     "even K splits"),
    ("--wide-split-only", "wide_split_only",
     "weighs the small-n K-split tiles only on wide weights, one block of W (before docs/design/0061)",
     "small-n K splits on wide weights alone"),
    ("--no-split3", "no_split3", "has no small-n K split over 3 CTAs (before docs/design/0063)", "no K split over 3"),
    ("--no-small-grid-split", "no_small_grid",
     "keeps its pick by cost where the grid is under a quarter of the SMs (before docs/design/0064)",
     "no small-grid split"),
    ("--no-deep-ring", "no_deep_ring",
     "keeps the ring at 8 stages where this one deepens it at n <= 16 (before docs/design/0066)", "no deeper ring"),
    ("--no-wide-k-splits", "no_wide_splits", "has no tiles of 192 rows of W splitting K (before docs/design/0067)",
     "no wide K splits"),
    ("--no-one-block-split", "no_one_block_split", "keeps a ping-pong tile of one block and 64 rows of x, one a CTA, "
     "where this one takes its K split over 2 on 128 rows of x (before docs/design/0073)", "no one-block K splits"),
    ("--unicast-ties", "unicast_ties", "gives each cost tie between x multicast to 2 CTAs and none to none "
     "(docs/design/0073)", "multicast ties to none"),
    ("--no-narrow-splits", "no_narrow_splits", "keeps a ping-pong tile of one block and 16-32 rows of x, one a CTA, "
     "where this one takes a K split over 2 of 16-32 rows (before docs/design/0073)", "no narrow K splits"),
    ("--no-mid-grid-splits", "no_mid_grid_splits", "keeps a grid under a quarter of the SMs (a lone ping-pong tile, "
     "half) past n = 16 where this one takes a K split of more CTAs in one wave (before docs/design/0074)",
     "no mid-n small-grid K splits"),
    ("--no-one-x", "no_one_x", "keeps a K split of two 64-row blocks of W where this one takes its twin of one block "
     "and one tile of x (before docs/design/0068)", "no one-x twins"),
    ("--pp-ties", "pp_ties", "gives every tie between a ping-pong tile and the same tile one a CTA to the ping-pong "
     "one (before docs/design/0068's PP_TIE_MAX_ACC)", "ping-pong ties"),
    ("--plain-ties", "plain_ties", "gives those ties to the tile one a CTA at every size (since docs/design/0069 that "
     "tile stages y in 16 bits, as the ping-pong one does)", "plain-tile ties"),
    ("--pp-wide-x-ties", "pp_wide_x_ties", "gives the ties where x has more tiles than W has blocks to the ping-pong "
     "tile at every size (docs/design/0068, before 0070)", "ping-pong ties where x has more tiles"),
    ("--split-wide-x", "split_wide_x", "keeps a K split of 256 rows of x in a grid of one wave where this one takes "
     "the pick with K whole (before docs/design/0072)", "K splits of 256 rows of x in one wave"),
)


def parse_constants(assignments: list[str], flag: str) -> dict[str, object]:
    """``sparse24_ws_rule``'s upper-case constants from ``NAME=VALUE`` (an int, a float, True or False, or for a
    range ``LO-HI``, HI included), each as its present value's type; ``flag`` names the option in what a bad one is
    told."""
    out = {}
    for item in assignments:
        name, _, value = item.partition("=")
        present = getattr(sparse24_ws_rule, name, None)
        if not name.isupper() or not isinstance(present, (int, float, range)) or not value:
            raise ValueError(f"{flag} takes NAME=VALUE for an int, float, bool or range constant of sparse24_ws_rule, "
                             f"not {item!r}")
        kind = "LO-HI" if isinstance(present, range) else "True or False" if isinstance(present, bool) else \
            type(present).__name__
        try:
            if isinstance(present, bool):  # bool("False") is True: the words alone
                out[name] = {"True": True, "False": False}[value]
            else:
                lo, _, hi = value.partition("-")
                out[name] = range(int(lo), int(hi) + 1) if isinstance(present, range) else type(present)(value)
        except (KeyError, ValueError):
            raise ValueError(f"{flag} {item!r}: {name} is {present!r}; give {kind}") from None
    return out


def set_constants(assignments: list[str]) -> dict[str, str]:
    """Sets ``sparse24_ws_rule``'s constants from ``NAME=VALUE`` (``parse_constants``) for this rule and clears
    ``ws_config``'s cache; returns what was set, as given."""
    for name, value in parse_constants(assignments, "--here-set").items():
        setattr(sparse24_ws_rule, name, value)
    ws_config.cache_clear()
    return dict(item.partition("=")[::2] for item in assignments)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--multicast-min-waves", type=float, default=None, metavar="W",
                    help="the other rule's: x multicast without a K split only in grids of more than W waves")
    ap.add_argument("--whole-k-min-x-tiles", type=int, default=None, metavar="T",
                    help="the other rule takes K whole over K splits of 256 rows of x in one wave from T tiles of x "
                         f"on (now {sparse24_ws_rule.WHOLE_K_MIN_X_TILES})")
    ap.add_argument("--here-set", nargs="+", default=[], metavar="NAME=VALUE",
                    help="this rule with its module's constants so (sparse24_ws_rule: NARROW_SPLIT_MAX_N=256, a range "
                         "as NARROW_SPLIT_K=512-1536): to time a step past its bounds against the rule without it")
    ap.add_argument("--other-set", nargs="+", default=[], metavar="NAME=VALUE",
                    help="the other rule with sparse24_ws_rule's constants so (as --here-set takes them)")
    ap.add_argument("--weights", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="the other rule's cost weights (RuleWeights), the rest as they are")
    for flag, _, what, _ in OTHER_RULES:
        ap.add_argument(flag, action="store_true", help=f"the other rule {what}")
    ap.add_argument("--table-misses", default=None, metavar="TABLE",
                    help="instead of another rule: each problem where this tile table's best tile ran --min-gain "
                         "faster than the rule's, against that tile")
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--shape-set", default="sweep set", choices=sorted(SHAPE_SETS))
    ap.add_argument("--shapes", nargs="+", default=None, metavar="MxK", help="these layers instead of a shape set")
    ap.add_argument("--batch", type=int, nargs="+", default=[n for n in BATCH_SIZES if n > 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20, help="graph_us's rep (ms), as the sweep's")
    ap.add_argument("--eager", action="store_true",
                    help="also each side called eagerly, host work included (wall per call of the sweep's "
                         "EAGER_CALLS back-to-back calls, EAGER_ROUNDS paired rounds, other and here alternating)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dests = [(flag[2:].replace("-", "_"), key) for flag, key, _, _ in OTHER_RULES]
    chosen = {dest: getattr(a, dest) for dest, _ in dests}  # by argparse's names: the results file's keys
    flags = {key: chosen[dest] for dest, key in dests} | {"whole_k_min_x_tiles": a.whole_k_min_x_tiles}
    try:
        flags["other_set"] = parse_constants(a.other_set, "--other-set")
    except ValueError as e:
        ap.error(str(e))
    other_rule = (a.multicast_min_waves is not None or a.whole_k_min_x_tiles is not None or a.weights
                  or a.other_set or any(chosen.values()))
    if a.plain_ties and (a.pp_ties or a.pp_wide_x_ties):
        ap.error(f"--plain-ties and {'--pp-ties' if a.pp_ties else '--pp-wide-x-ties'} give the same ties to "
                 f"opposite tiles: give one of them")
    if bool(other_rule) == (a.table_misses is not None):
        ap.error(f"give the other rule (--multicast-min-waves, --whole-k-min-x-tiles, --weights, --other-set, "
                 f"{', '.join(flag for flag, *_ in OTHER_RULES)} or more of them) or --table-misses, not both")
    try:
        shapes = SHAPE_SETS[a.shape_set]() if a.shapes is None else [tuple(map(int, s.split("x"))) for s in a.shapes]
    except ValueError:
        ap.error(f"--shapes takes layers as MxK (4096x1600), not {a.shapes}")
    try:
        here_set = set_constants(a.here_set)
    except ValueError as e:
        ap.error(str(e))
    waves = sparse24_ws_rule.MULTICAST_MIN_WAVES if a.multicast_min_waves is None else a.multicast_min_waves
    other_w = weights_of(a.weights)
    sms, gpu = sm_count(0), device_facts(0)
    if a.table_misses:
        others = table_misses(a.table_misses, sms, a.min_gain, gpu)
        problems = list(others)
        print(f"{len(problems)} problems where {a.table_misses}'s best tile ran {a.min_gain:.0%} or more faster than "
              f"the rule's", flush=True)
    else:
        problems = moved(shapes, a.batch, sms, waves, other_w, **flags, gpu=gpu)
        others = {p: other_pick(*p, sms, waves, other_w, **flags, gpu=gpu) for p in problems}
        said = "".join(f" and {words}" for _, key, _, words in OTHER_RULES if flags[key]) + (
            "" if a.whole_k_min_x_tiles is None else f" and K whole from {a.whole_k_min_x_tiles} tiles of x") + (
            "" if not a.other_set else f" and {' '.join(a.other_set)}")
        print(f"{len(problems)} problems where the rule with x multicast past {waves:g} waves (now "
              f"{sparse24_ws_rule.MULTICAST_MIN_WAVES}), {other_w}{said} picks another tile", flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, dtype = [], torch.bfloat16

    def write():  # after each shape: a run cut off by a time limit keeps what it timed
        results.write("sparse24-rule-ab", {"rows": rows}, a.out, dtype="bf16", sms=sms,
                      here={"multicast_min_waves": sparse24_ws_rule.MULTICAST_MIN_WAVES, "set": here_set,
                            "weights": dataclasses.asdict(WEIGHTS)},
                      other={"multicast_min_waves": waves, "weights": dataclasses.asdict(other_w), **chosen,
                             "whole_k_min_x_tiles": a.whole_k_min_x_tiles, "set": a.other_set},
                      shape_set=a.shape_set if a.shapes is None else "given", shapes=a.shapes,
                      table_misses=a.table_misses, min_gain=a.min_gain, rounds=a.rounds, rep=a.rep, eager=a.eager)

    torch.manual_seed(0)
    with torch.inference_mode():
        for m, k in dict.fromkeys((m, k) for _, m, k in problems):
            w = prune(torch.randn(m, k, device="cuda")).to(dtype)
            held = (lambda c: compress(c).packed()) if pack_reason(m, k) is None else compress  # as the sweep's
            w24 = held(w)
            copies = copies_past_l2(l2, w24.values.nbytes + w24.metadata.nbytes, "cold")
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            sides = {side: [held(c) for c in ws] for side in ("here", "other")}
            for n in [n for n, mm, kk in problems if (mm, kk) == (m, k)]:
                cfgs = {"here": ws_config(n, m, k, sms, gpu=gpu), "other": others[(n, m, k)]}
                x = torch.randn(n, k, device="cuda").to(dtype)
                ref = F.linear(x.double(), w.double())
                dense_err = float((F.linear(x, w).double() - ref).abs().max() / ref.abs().max())
                fns = {"dense": _cycling([lambda c=c: F.linear(x, c) for c in ws])}
                errs = {}
                for side, cfg in cfgs.items():
                    call = MmaLinear(None, FixedTile(cfg))
                    y = call(x, sides[side][0].values, sides[side][0].metadata, None)
                    errs[side] = float((y.double() - ref).abs().max() / ref.abs().max())
                    fns[side] = _cycling([lambda call=call, c=c: call(x, c.values, c.metadata, None)
                                          for c in sides[side]])
                wrong = [side for side, e in errs.items() if not e <= 2 * dense_err + 1e-3]
                times = {name: [] for name in fns}
                for r in range(a.rounds):  # dense, A, B, B, A, dense: a drift lands on both tiles alike
                    order = ["dense", "here", "other"] if r % 2 == 0 else ["dense", "other", "here"]
                    for name in order + order[::-1]:
                        times[name].append(graph_us(fns[name], a.rep))
                med = {name: statistics.median(t) for name, t in times.items()}
                ratio = statistics.median(o / h for o, h in zip(times["other"], times["here"]))
                row = {"m": m, "k": k, "n": n, "weight_copies": copies, "here": str(cfgs["here"]),
                       "other": str(cfgs["other"]), "dense_us": med["dense"], "here_us": med["here"],
                       "other_us": med["other"], "other_over_here": ratio, "errors": errs, "wrong": wrong}
                if a.eager:  # paired rounds: the host's speed drifts within seconds (bench/sweep.py)
                    dev = torch.device("cuda")
                    pairs = [(host_us_per_call(fns["other"], dev, EAGER_CALLS),
                              host_us_per_call(fns["here"], dev, EAGER_CALLS)) for _ in range(EAGER_ROUNDS)]
                    row |= {"eager_here_us": statistics.median(h for _, h in pairs),
                            "eager_other_us": statistics.median(o for o, _ in pairs),
                            "eager_other_over_here": statistics.median(o / h for o, h in pairs)}
                rows.append(row)
                eager = f"; eager other/here {row['eager_other_over_here']:.3f}" if a.eager else ""
                print(f"  {m}x{k} n={n}: here {med['dense'] / med['here']:.2f}x, other "
                      f"{med['dense'] / med['other']:.2f}x of dense; other/here {ratio:.3f}{eager}"
                      f"{'  WRONG ' + str(wrong) if wrong else ''}", flush=True)
            write()
    write()
    ratios = [r["other_over_here"] for r in rows]
    if ratios:
        print(f"other's time over here's: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max "
              f"{max(ratios):.3f}, here faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
