"""The tile rule of ``cuda_ws`` (``sparse24_ws.py``, the warp-specialized ``wgmma.sp`` kernels): pure functions.

``WsConfig`` is a tile: how many rows of x and of W a CTA multiplies, how a cluster shares x or splits K, the ring's
depth, and the schedule (one CTA a tile, persistent ping-pong, persistent split).  ``ws_candidates`` is every tile
the kernels can run for a problem; ``ws_config`` is the rule's pick among them, a function of (N, M, K, SMs, the GPU's
facts: the clusters it runs at once and its DRAM bandwidth, ``gpu_facts``), fitted to measured tile tables
(``tools/fit_ws_rule.py``) and checked through the sweep's path (``bench/sparse24_rule_ab.py``).  The comments beside
each term say which measurements it comes from; docs/design/ has the records.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from .gpu_facts import GpuFacts, model_facts
from .sparse24_sp import SM_SHARED
from .sparse24_wg import instruction_n

# The consumers' registers where a CTA has two consumer warpgroups (384 threads, 168 registers each at entry):
# the producer gives up all but 40 (CUTLASS's split for the same CTA: 128 x 40 + 256 x 232 = 384 x 168).  Three
# (512 threads, 128 at entry): 128 x 40 + 384 x 152 = 63488 of the SM's 65536.
CONSUMER_REGS = {1: 0, 2: 232, 3: 152}
# Three consumer warpgroups hold BN x 64 / 128 accumulators a thread each: at most 192 rows of x (96) in 152.
_WIDE_MAX_BN = 192
_MAX_STAGES = 8


@dataclass(frozen=True)
class WsConfig:
    bn: int  # rows of x (tokens) a CTA multiplies: a multiple of 8, at most 256 (one tensor-map box)
    wm: int = 2  # consumer warpgroups along M: 64 rows of W each
    cm: int = 1  # CTAs of a cluster along M (grid y) that share x's tile, each loading BN / CM rows for all
    kc: int = 1  # CTAs of a cluster along K (grid z), their sums met through distributed shared memory
    stages: int = 4  # 64-column steps in the shared-memory ring
    sk: bool = False  # persistent, tail tiles split along K (cuda/sparse24_sk.cu, sk_plan): one CTA an SM, no clusters
    pp: bool = False  # persistent ping-pong (cuda/sparse24_pp.cu): one CTA an SM, each consumer warpgroup its own
    #                   tile of BN x 64 wm, no clusters
    push: bool = True  # K split without multicast: the partial sums pushed to a buffer of their own (recv_bytes);
    #                    False where that buffer would cost the grid a wave (ws_config, push_pays)

    def __post_init__(self):
        if self.pp and (self.sk or self.cm > 1 or self.kc > 1 or self.bn % 16 or self.bn * self.wm > 256):
            raise ValueError(f"{self}: a ping-pong tile has no split or cluster, BN a multiple of 16, and at most "
                             f"256 x 64 accumulators a warpgroup (BN x wm <= 256)")

    def __repr__(self) -> str:
        # The measured tables (bench/results/sparse24-ws-tiles-*.json) are keyed by this text: pp only where set.
        return (f"WsConfig(bn={self.bn}, wm={self.wm}, cm={self.cm}, kc={self.kc}, stages={self.stages}, "
                f"sk={self.sk}" + (", pp=True" if self.pp else "") + ("" if self.push else ", push=False") + ")")

    @property
    def ni(self) -> int:
        return instruction_n(self.bn)

    @property
    def kind(self) -> str:
        """The schedule, in words: how the benches group tiles (``tools/table_vs_sweep.py``)."""
        if self.pp or self.sk:
            return "ping-pong" if self.pp else "split persistent"
        if self.kc > 1:
            return "K split"
        return "x multicast, K whole" if self.cm > 1 else "one CTA a tile"

    @property
    def rows(self) -> int:
        return 64 * self.wm

    def grid(self, n: int, m: int) -> tuple[int, int, int]:
        """The one-a-tile launch's grid for n rows of x and M rows of W: tiles of x, row blocks of W padded to a
        whole number of clusters (CM along y), and K's slices (KC along z)."""
        return -(-n // self.bn), -(-(-(-m // self.rows)) // self.cm) * self.cm, self.kc

    @property
    def threads(self) -> int:
        return 384 if self.pp else 128 * (self.wm + 1)

    @property
    def stage_bytes(self) -> int:
        """One 64-column step: x's BN rows of 128 bytes, then each 16-row tile's 1152 bytes of W, rounded to 1024."""
        return -(-(self.bn * 128 + 4 * self.wm * 1152) // 1024) * 1024

    @property
    def staging_bytes(self) -> int:
        """Ping-pong: one consumer warpgroup's 16-bit tile of y, rows padded by 16 bytes, rounded to 1024."""
        return -(-self.bn * (2 * self.rows + 16) // 1024) * 1024 if self.pp else 0

    @property
    def shared(self) -> int:
        """Dynamic shared memory: the ring (or the partial sums, where they meet in shared memory: not persistent),
        the ping-pong's two staging buffers of y, the mbarriers (and the ping-pong's two order barriers), and 1 KiB
        to align to 1024."""
        return self._fixed + self.recv_bytes

    @property
    def _fixed(self) -> int:
        sums = 0 if self.sk or self.pp else self.bn * (self.rows + 4) * 4
        bars = 16 * self.stages + (16 if self.pp else 0)
        return max(self.stages * self.stage_bytes, sums) + 2 * self.staging_bytes + bars + 1024

    @property
    def recv_bytes(self) -> int:
        """Where K splits over a cluster without multicast: the other K slices' partial sums of the rows this CTA
        stores, pushed to it past the barriers, and their barrier (cuda/sparse24_ws.cu, RECV_BYTES); 0 for other
        tiles, where not ``push``, and where they would not fit the SM beside the ring (their sums then meet through
        the cluster's loads)."""
        if self.sk or self.pp or self.kc == 1 or self.cm > 1 or not self.push:
            return 0
        recv = (self.kc - 1) * (self.bn // self.kc) * (self.rows + 4) * 4 + 16
        return recv if self._fixed + recv <= SM_SHARED else 0


def _deepest(bn: int, wm: int, cm: int, kc: int, sk: bool = False, pp: bool = False) -> WsConfig | None:
    """The tile with the deepest ring (up to 8 steps) that fits the SM's shared memory; None if not 3."""
    one = WsConfig(bn, wm, cm, kc, 1, sk, pp)
    stages = min(_MAX_STAGES, (SM_SHARED - 1024 - 16 * _MAX_STAGES - 16 - 2 * one.staging_bytes) // one.stage_bytes)
    cfg = WsConfig(bn, wm, cm, kc, stages, sk, pp)
    return cfg if stages >= 3 and cfg.shared <= SM_SHARED else None


# Tiles of x past the halvings of 256 where one of them fills the SMs' waves better: 36 tiles of 128 rows of W at
# n = 1024 are 144 CTAs of 256 rows of x (two waves on 132 SMs, the second 12 CTAs) or 216 of 192 rows.
_BETWEEN = (96, 160, 192, 224)
# Tiles of x narrower than n needs (16, 32 rows), of one 64-row block of W, up to this many K steps: they ran
# 0.91-0.97x dense where the halvings ran 0.87-0.93x on BERT / GPT-2-sized layers at n = 32-256, and lost at K of
# 3072 and more, or with more rows of W a CTA (sparse24-ws-narrow-h100.json).
_NARROW_MAX_STEPS = 16


def ws_candidates(n: int, m: int, k: int, pingpong: bool = True, split: bool = False,
                  between: bool = False, gated: bool = False) -> list[WsConfig]:
    """Every tile the kernel can run for this problem, the rule's space: one CTA a tile (``sparse24_ws.cu``) and,
    with ``pingpong``, the persistent ping-pong tiles (``cfg.pp``).  With ``split``, the persistent variant with
    split tails (``cfg.sk``) too, which ``bench/sparse24_wg_tiles.py --kernel ws`` also measures; it is not the
    rule's: measured slower than the one-a-tile tiles on 86 of 88 problems (docs/design/0006).  With ``between``,
    tiles of x of ``_BETWEEN`` rows too, where they are fewer than n.

    Where K is at most ``_NARROW_MAX_STEPS`` steps, tiles of 16 and 32 rows of x of one 64-row block of W too, where n
    needs more: a short K loop leaves a CTA's time to its fixed costs, and a grid of more, smaller CTAs fills more
    SMs (docs/design/0017).

    K splits over 2 or 4 CTAs of a cluster where each keeps 4 steps or more, also where the split does not divide K's
    steps (``k_slices``: 1600 columns are 25 steps; docs/design/0058).

    Tiles of 192 rows of W (``wm = 3``: three consumer warpgroups, or a ping-pong warpgroup's three 64-row blocks)
    fill the SMs where 64 and 128 rows do not (docs/design/0016).  Past n = ``SPLIT_MAX_N`` those of at most
    ``WIDE_SPLIT_MAX_BN`` rows of x split K across a cluster where each slice keeps ``WIDE_SPLIT_MIN_SLICE`` steps or
    more (``wide_k_splits``, docs/design/0067).

    At n <= ``SPLIT_MAX_N``, K splits over 4 CTAs with x's tile twice what n needs too (``small_n_splits``), except
    under a gated epilogue (``gated``), whose split tiles were not timed."""
    out = []
    fitted = -(-(-(-n // -(-n // 256))) // 16) * 16  # n in the fewest N tiles of at most 256, rounded to 16
    more = {b for b in _BETWEEN if b < n} if between else set()
    halvings = {min(fitted, b) for b in (64, 128, 256)} | {fitted}
    narrow = {b for b in (16, 32) if b < n} - halvings if k // 64 <= _NARROW_MAX_STEPS else set()
    for bn in sorted(halvings | more | narrow):
        for wm in (1,) if bn in narrow else (1, 2, 3):
            for cm in (1, 2, 4) if wm < 3 or bn <= _WIDE_MAX_BN else ():
                for kc in (1, 2, 4) if wm < 3 else (1,):
                    if kc > 1 and k // 64 < 4 * kc or bn % (8 * kc) or bn % (8 * cm):
                        continue
                    if cm * kc > 8 or cm > 1 and -(-m // (64 * wm)) < cm:  # 8 CTAs a cluster; an M group of tiles
                        continue
                    cfg = _deepest(bn, wm, cm, kc)
                    if cfg is not None:
                        out.append(cfg)
            persistent = (_deepest(bn, wm, 1, 1, sk=True) if split and wm < 3 else None,
                          _deepest(bn, wm, 1, 1, pp=True) if pingpong and bn % 16 == 0 and bn * wm <= 256 else None)
            out += [c for c in persistent if c is not None]
    splits = [] if gated else small_n_splits(n, k)
    out += [c for c in splits if c not in out]
    wide = wide_k_splits(out, k) if n > SPLIT_MAX_N else []  # at n <= 16, K splits are small_n_splits'
    return out + [c for c in wide if (k // 64) // c.kc >= WIDE_SPLIT_MIN_SLICE and c.bn <= WIDE_SPLIT_MAX_BN]


# Tiles of 192 rows of W split K over a cluster only where each slice keeps this many 64-column steps or more, and
# x's tile is at most WIDE_SPLIT_MAX_BN rows.  The cluster's fixed cost (its barriers; the partial sums of 192 rows
# met, without the push where its buffer does not fit beside the ring) weighs on a short slice, which tile_cost prices
# low.  Through the sweep's path (sparse24-rule-ab-wide-k-splits-*-h200.json, f60b710; docs/design/0067) the rule with
# them at any slice picked them on 67 problems: slices of 40 steps or fewer ran 0.87-1.15x the time (25 of 31
# slower), 41-95 steps 0.90-1.13x (6 of 24 slower), and all 12 of 96 steps or more 0.835-0.968x.  Tiles of 192 x 192
# (a 147 KiB f32 tile of sums, 5 stages in the ring) with K over 2 ran 1.15-1.22x the time at n = 384 (5 problems,
# -final-, 2ba8f9c), and 160 and 192 rows of x 1.41-2.17x the best tile's in sparse24-ws-wide-h100.json (56cd67b).
WIDE_SPLIT_MIN_SLICE = 96
WIDE_SPLIT_MAX_BN = 128


def wide_k_splits(space: list[WsConfig], k: int) -> list[WsConfig]:
    """Beside each tile of ``space`` of 192 rows of W (``wm = 3``) with K whole and one CTA a tile, the same tile with
    K split over 2 and 4 CTAs of a cluster, where each slice keeps 4 steps or more and the tile is not in ``space``
    (``ws_candidates`` holds those past n = 16 of slices of ``WIDE_SPLIT_MIN_SLICE`` steps or more and at most
    ``WIDE_SPLIT_MAX_BN`` rows of x; the benches time the rest)."""
    wide = [_deepest(c.bn, 3, c.cm, kc) for c in space if c.wm == 3 and c.kc == 1 and not (c.pp or c.sk)
            for kc in (2, 4) if k // 64 >= 4 * kc and c.bn % (8 * kc) == 0 and c.cm * kc <= 8]
    return [c for c in dict.fromkeys(wide) if c is not None and c not in space]


# Split-K parts shorter than this many 64-column steps are not worth their hand-over.
_SK_MIN_STEPS = 4
_MAX_SPLITS = 8
_PER_SPLIT = 0.03  # the tail's estimated time grows by this share per part past the first (hand-over, fill)


@dataclass(frozen=True)
class SkPlan:
    """How a persistent launch (``cuda/sparse24_sk.cu``) spreads its tiles; a pure function of the problem and SMs."""

    grid: int  # CTAs, at most one per SM, all resident at once
    tiles_n: int  # tiles along N (x's rows); tiles along M follow from M in the kernel
    dp_tiles: int  # the first tiles, whole, in whole waves of the grid
    splits: int  # parts along K of each tile left, run part-major (1: whole)
    rest: int  # the tiles left after the whole waves
    part_floats: int  # f32 of one handed-over part (BN x rows)

    @property
    def slots(self) -> int:
        """Parts handed over: all but each split tile's last."""
        return (self.splits - 1) * self.rest

    @property
    def workspace_bytes(self) -> int:
        """The parts' flags (in whole KiB) and the parts; none where no tile is split."""
        return -(-4 * self.slots // 1024) * 1024 + 4 * self.slots * self.part_floats if self.slots else 0


@functools.lru_cache(maxsize=4096)
def sk_plan(cfg: WsConfig, n: int, m: int, k: int, sms: int) -> SkPlan:
    """Whole waves of tiles, then the tiles left (less than a wave) split along K into the number of parts that
    fills the SMs best: tail time ceil(rest x parts / SMs) / parts, plus ``_PER_SPLIT`` a part."""
    tiles_n, tiles_m, steps = -(-n // cfg.bn), -(-m // cfg.rows), -(-k // 64)  # K padded to 64 (layout.padded_k)
    tiles = tiles_n * tiles_m
    waves, rest = divmod(tiles, sms)
    if rest == 0:
        return SkPlan(min(sms, tiles), tiles_n, tiles, 1, 0, cfg.bn * cfg.rows)
    options = [s for s in range(1, _MAX_SPLITS + 1) if s == 1 or steps // s >= _SK_MIN_STEPS]
    splits = min(options, key=lambda s: -(-rest * s // sms) / s * (1 + _PER_SPLIT * (s - 1)))
    grid = sms if waves else min(sms, rest * splits)
    return SkPlan(grid, tiles_n, waves * sms, splits, rest, cfg.bn * cfg.rows)


@dataclass(frozen=True)
class RuleWeights:
    """The tile rule's cost weights, in rough cycles of one SM (``tools/fit_ws_rule.py`` fits them)."""

    mma: float  # per (row of x x 64-row block) of a 64-column step: the tensor cores' part
    copy: float  # per byte a step brings into the SM, where it exceeds the MMAs'
    step: float  # per step: barriers, the A fragments' loads, issue
    l2: float  # per byte a step brings in, where the grid takes more than one wave (L2 and DRAM contended)
    cta: float  # per CTA: launch, pipeline fill, epilogue
    split: float  # per (row x 64-row block) of a tile's partial sums met across the cluster, per extra K slice
    pp_tile: float  # ping-pong: per tile past a CTA's first (its epilogue, where the other warpgroup's K loop
    #                 does not hide it)
    mma_floor: float = 0.0  # per step, the least its MMAs take however few rows they have: a small tile's wgmma
    #                         is latency-bound, not rate-bound (docs/design/0057)
    cluster: float = 0.0  # per CTA of a cluster of more than one (cm x kc > 1): the cluster barriers at its start
    #                       and end, whatever its K loop (sparse24-ws-small-h100.json: up to 0.73x at K <= 1024)


# Fitted (tools/fit_ws_rule.py) on five tables of tiles timed as CUDA graph replays (bench/sparse24_wg_tiles.py
# --kernel ws): sparse24-ws-tiles-h100.json and -h200.json (11 sweep shapes x n = 32..4096, every candidate, the
# kernels before the core-matrix layout), sparse24-ws-core-matrix-h100.json (the same problems, the 6 least-cost
# tiles and the between tiles, the kernels since), sparse24-ws-small-h100.json and sparse24-ws-small-big-n-h100.json
# (8 layers of BERT / GPT-2 / Phi sizes, n = 1..256 and 512..4096, every candidate), and the 114 problems two H100
# sweeps timed with different tiles (7548a19 and 695fe71).  The chosen tile's time against the best measured,
# mean: 0.974, 0.967, 0.977, 0.997, 0.969 and 0.994; worst 0.72x (4608x3584 n = 4096).  An L2 term for one-wave
# grids too was tried (695fe71) and lost on the sweep: docs/design/0014.  The tiles of 192 rows (56cd67b, the 6
# least-cost tiles and the 4 least-cost of 192 rows on 11 shapes x n = 128..4096, sparse24-ws-wide-h100.json) left
# the weights where they were; the picks there: 0.98 of the best on average, none more than 3% under the old rule's.
# step 384 -> 453 since the K slices push their sums (docs/design/0051): fitted with the picks at n = 1-16 and
# 2048-8192 held (fit_ws_rule.py --hold) on sparse24-ws-top8-pushed-h100.json and -h200.json (43 sweep shapes x
# n = 32..1024, a276283); 15 picks move to fewer, K-split steps, means 0.982 -> 0.983 (H100), 0.983 -> 0.987 (H200).
# mma_floor 0 -> 300 (docs/design/0057): a ping-pong tile of 32 or 64 rows of x and one 64-row block ran a 2048-column K
# in the same 7.0 us at n = 32 and 64, so a step of few rows costs its latency, not its rows.  Moves 4 sweep-set picks
# (3072x3072 n = 64, 128; 768x3072 n = 256, 512) and 17 of the held-out models' at n = 32-256 to K-split tiles; through
# the sweep's path (sparse24_rule_ab.py, b65be27, H200) 20 of those 21 ran faster, by 0.69-0.98x of the time, one
# 1.025x.  Flat between 250 and 400 over the graph_us tile tables.  Its 21 held-out moves at n = 1-16 (bn 16 ping-pong
# -> K split over 2) ran 1.05-1.35x faster (0058).
# mma_floor 300 -> 350 (0058): moves no pick of the sweep set or the LM heads; 4 of the held-out models' and 21 of
# 1584 on a generic grid of 11 M x 12 K, 18 of them lone 64-row ping-pong tiles of grids under a wave to K splits over
# 4 with 4x the CTAs.  Timed through the sweep's path (466dcfa, H200), all 23 moves ran faster: new over old time
# median 0.73, at most 0.99; 512-3072-row layers of K = 1536-1600 went from 0.84-0.98x of dense to 1.14-1.20x.
WEIGHTS = RuleWeights(mma=3.34, copy=0.00625, step=453, l2=0.014, cta=30600, split=18.6, pp_tile=6530,
                      mma_floor=350, cluster=10000)


def _cluster_sms(cfg: WsConfig, sms: int, gpu: GpuFacts | None = None) -> int:
    """The SMs a grid of ``cfg``'s clusters places on at one CTA an SM: fewer than all where a cluster has 3 CTAs or
    more (a grid of 40 clusters of 3 ran 1.5x slower than one of 36 on an H200, where 39 place: docs/design/0063).
    ``gpu``: the device's facts (``gpu_facts.device_facts``), else ``GpuFacts.model(sms)``."""
    return (gpu or model_facts(sms)).at(cfg.cm * cfg.kc)


def k_slices(k: int, kc: int) -> list[range]:
    """The 64-column steps of K each of a cluster's ``kc`` slices runs (``sparse24_ws.cu``: ``step0``, ``steps``): as
    even as they divide, at most one step apart where ``kc`` does not divide them, the last the longest."""
    ksteps = k // 64
    return [range(ksteps * z // kc, ksteps * (z + 1) // kc) for z in range(kc)]


def tile_cost(cfg: WsConfig, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
              gpu: GpuFacts | None = None) -> float:
    """The rule's estimate of a tile's time, relative: lower is faster (not for the split persistent variant)."""
    n_tiles, m_tiles, slices = cfg.grid(n, m)
    ctas = n_tiles * m_tiles * slices
    step_bytes = cfg.bn * 128 / cfg.cm + cfg.wm * 4608
    waves = -(-ctas // _cluster_sms(cfg, sms, gpu))  # ping-pong: tiles a CTA, one after another
    mma = max(cfg.bn * cfg.wm * w.mma, w.mma_floor)
    step = w.step + max(mma, step_bytes * w.copy) + (w.l2 * step_bytes if waves > 1 else 0)
    if cfg.pp:
        return waves * (k // 64 * step + w.pp_tile) + w.cta - w.pp_tile
    clustered = w.cluster if cfg.cm * cfg.kc > 1 else 0.0
    longest = -(-(k // 64) // cfg.kc)  # a cluster waits for its longest K slice (k_slices)
    return waves * (longest * step + w.cta + clustered + w.split * (cfg.kc - 1) * cfg.bn * cfg.wm)


# Ties between tiles that differ only in x's multicast (cm): where a step brings at least this many rows of x (16 KiB,
# most of its bytes beside W's 4.5 KiB a 64-row block), x shared by 2 CTAs along M.  tile_cost counts a step's bytes
# only past its MMAs' time, so it prices cm = 1, 2 and 4 alike in a cluster that K's split already pays for; measured,
# cm = 2 with kc = 2-4 ran 3-12% faster than cm = 1 at K of 13824-36864 and n = 128-512
# (sparse24-ws-largek-h100.json), and was best or within 2% where cm = 4 also fit.
_MCAST_TIE_MIN_BN = 128
# Ties between a ping-pong tile and the same tile one a CTA (grids of one wave, where each CTA has one tile) go to the
# ping-pong one where a warpgroup's tile is under PP_TIE_MAX_ACC rows of x x 64-row blocks (bn x wm); from it on (64 x 3
# and 128 x 2) they go to the one-a-CTA tile, whose warpgroups all issue and whose ring is a stage deeper (the ping-pong
# tile stages two warpgroups' y).  At 128 x 2, over every tile table's such ties, the one-a-CTA tile ran 0.962 of the
# ping-pong one's time (geometric mean of 99, 94 faster, both GPUs), and through the sweep's path its 15 moves
# 1.003-1.059x faster (sparse24-rule-ab-pp-ties-*-h200.json, 0f965bd; docs/design/0068).  At 64 x 3 through the
# sweep's path the one-a-CTA tile ran 0.963 of the time at the median of 27 (0.93-1.01, 24 faster; sweep set and
# held-out models, sparse24-rule-ab-plain-ties-*-h200.json at d27002c), and where x has more tiles than W has blocks,
# which 0068 had kept ping-pong, 0.978 of 8 (0.95-1.01; 128 x 2 alone 0.985-1.014, where 0068 read the ping-pong
# tile 1.03-1.06x faster; sparse24-rule-ab-plain-wide-x-ties-*-h200.json).  Under 64 x 3 the ping-pong tile ran
# faster at the median of every kind (1.01-1.06x; 32 x 3 0.999x): docs/design/0070.
PP_TIE_MAX_ACC = 192
PP_TIE_WIDE_X = False  # True: ties where x has more tiles than W has blocks go to ping-pong at every size (0068)


def _x_wider(cfg: WsConfig, n: int, m: int) -> bool:
    """Whether x has more tiles than W has blocks of ``cfg``'s rows."""
    tiles_n, blocks, _ = cfg.grid(n, m)
    return tiles_n > blocks


def rule_order(cfg: WsConfig, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
               gpu: GpuFacts | None = None) -> tuple[float, bool, bool]:
    """The rule's sort key: ``tile_cost``, then ping-pong first (the note at ``PP_TIE_MAX_ACC``), then x multicast to 2
    CTAs where x's tile is ``_MCAST_TIE_MIN_BN`` rows or more.  A ping-pong tile and the same tile one a CTA cost alike
    where each CTA has one tile; there the ping-pong one ran faster on 20 of 24 problems, by up to 6%
    (sparse24-ws-small-h100.json: tiles of 16-64 rows of x)."""
    pp_first = cfg.pp and (cfg.bn * cfg.wm < PP_TIE_MAX_ACC or PP_TIE_WIDE_X and _x_wider(cfg, n, m))
    return tile_cost(cfg, n, m, k, sms, w, gpu), not pp_first, cfg.bn >= _MCAST_TIE_MIN_BN and cfg.cm != 2


# x multicast without a K split (cm > 1, kc = 1) only in grids of more than this many waves of CTAs.  Each such
# least-cost tile, timed beside the same tile without multicast (bench/sparse24_wg_tiles.py --unicast-pairs: 141 sweep
# problems and 61 LM heads a GPU, sparse24-ws-unicast-*.json): in grids of at most 2 waves, multicast's time over the
# other's was 1.04-1.06 at the median on both GPUs (at least 0.97); past 2 waves the H100 gains from multicast in
# large grids (medians 0.86-0.90 past 16 waves) and the H200 does not (0.97-1.05): docs/design/0054.  A threshold of
# 16 waves on the H200 alone read as a loss through the sweep's path and was not taken (0055).
MULTICAST_MIN_WAVES = 2


def multicast_pays(cfg: WsConfig, n: int, m: int, sms: int) -> bool:
    """Whether the rule keeps ``cfg``'s x multicast: always where K is split across the cluster too (its barriers
    are paid already, ``_MCAST_TIE_MIN_BN``), else only in grids of more than ``MULTICAST_MIN_WAVES`` waves."""
    return cfg.cm == 1 or cfg.kc > 1 or math.prod(cfg.grid(n, m)) > MULTICAST_MIN_WAVES * sms


def least_cost(space, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
               gpu: GpuFacts | None = None) -> WsConfig:
    """The first of ``space`` in ``rule_order`` (further ties: the first in its order)."""
    return min(space, key=lambda c: rule_order(c, n, m, k, sms, w, gpu))


def rule_pick(space, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
              gpu: GpuFacts | None = None) -> WsConfig:
    """``least_cost`` of ``space``, without x multicast where that does not pay (``multicast_pays``)."""
    cfg = least_cost(space, n, m, k, sms, w, gpu)
    return cfg if multicast_pays(cfg, n, m, sms) else replace(cfg, cm=1)


# At n <= SPLIT_MAX_N the rule's space has tiles of 32 rows of x, twice what n needs, so that K splits over a
# cluster of 4 CTAs (each writes 8 rows of y), of one or two 64-row blocks of W: up to four times the CTAs of the
# 16-row tiles, whose grids fill under half of the SMs on weights of few rows.  Until docs/design/0061 the one-block
# tile was the wide weights' own (dispatch.wide_weight), outside the cost (0047: 1.04-1.37x of the rule's tile at
# n = 16, sparse24-small-n-wide-split-h{100,200}.json, b69c688).  Both tiles timed over the sweep set and the held-out
# models at n = 1, 8 and 16 beside the rule's first 6 and cuda_sp's first 2 (sparse24-small-n-split-wm-h200.json and
# -held-out-h200.json, fa624d0): picked by cost, they moved 13 sweep-set and 35 held-out picks, whose time went to
# 0.997x and 0.965x of the rule's before (geometric means over all 129 and 102 problems), lifting 1536x1536, 1600x1600
# and 2048x1536 at n = 8 and 16 from 0.91-0.93x of dense to 1.16-1.32x.  The cost model picks the two-block tile from
# 2048 rows, where the one-block grid passes the 120 SMs clusters of 4 place on.  Not gated (ws_candidates).
SPLIT_MAX_N = 16
_SPLITS = ((32, 1, 4), (24, 1, 3))  # bn, cm, kc: each K slice stores 8 rows of y
# The split over 3 (docs/design/0063) fills SMs that the splits over 2 and 4 leave idle: 36 row blocks of 128 rows
# (4608 rows) are 72 CTAs over 2, 108 over 3, and 144 over 4, past the 120 SMs clusters of 4 place on.  Weighed by
# tile_cost alone it also took weights whose pick without it runs more CTAs (4096 rows: 128 CTAs of one 64-row block
# over 2 against 96 of two blocks over 3), and there ran 1.4-5.4% slower through the sweep's path
# (sparse24-rule-ab-split3-*-h200.json): at n <= 16 a call streams its weight, and the cost counts a step's time,
# not the bytes the grid keeps in flight.  So ws_config takes it only where its grid has more CTAs.


def small_n_splits(n: int, k: int) -> list[WsConfig]:
    """The K-split tiles the rule weighs at n <= ``SPLIT_MAX_N``, of x's tile widened so that each of K's slices
    stores 8 rows of y (32 rows over 4 slices, 24 over 3), one and two 64-row blocks of W, where each slice keeps 4
    steps or more."""
    if n > SPLIT_MAX_N:
        return []
    return [c for bn, cm, kc in _SPLITS if k // 64 >= 4 * kc for wm in (1, 2)
            if (c := _deepest(bn, wm, cm, kc)) is not None]


@functools.lru_cache(maxsize=4096)
def ws_config(n: int, m: int, k: int, sms: int, gated: bool = False, w: RuleWeights = WEIGHTS,
              gpu: GpuFacts | None = None) -> WsConfig:
    """The tile for N = n: ``rule_pick`` of ``ws_candidates`` under ``w``, a K split over 3 CTAs only where its grid
    runs more CTAs than the pick without it (docs/design/0063), a tile of 192 rows of W splitting K only where its
    tile of x is as wide as the pick's without it (0067), a K split of two blocks of W given way to its twin of one
    block and one tile of x (``one_x_twin``, 0068), a K split of 256 rows of x over 2 CTAs in one wave given way to
    the pick with K whole (``split_wide_x``, 0072, 0073), a ping-pong tile of one block one a CTA given way to its K
    split over 2 on as many CTAs (``one_block_split_of``, 0073), a grid under a quarter of the SMs past n = 16 (a
    lone ping-pong tile, half) given way to a K split of more CTAs (``mid_grid_split``, 0074), one of 16-32 rows of x
    past n = 16 to a K split over 2 (``narrow_split_of``, 0073, 0074), one at n <= 16 to a small-n split
    (``small_grid_split``, 0064), its ring deepened where the grid holds too few bytes in flight at n <= 16
    (``with_ring``, 0066), with its K slices pushing their sums where that pays.  ``gated``: among the tiles a gated
    epilogue runs on (``gated_tile``), none of them small-n splits, deeper rings or 192-row K splits (none was timed
    gated), nor tiles of one block (no twins), and K splits of 256 rows of x and grids under a quarter of the SMs past
    n = 16 kept.
    ``gpu``: the GPU's cluster slots, which waves are counted by, and its DRAM bandwidth (``WsKernel.config`` passes
    the driver's, docs/design/0065); None, the model of a GPU of ``sms`` SMs (``GpuFacts.model``)."""
    if gpu is not None and gpu.sms != sms:  # the waves would count one GPU's SMs and another's cluster slots
        raise ValueError(f"sms = {sms}, but the GPU facts given are of a GPU of {gpu.sms} SMs")
    cfg = cost_pick(n, m, k, sms, gated, w, gpu)
    return rule_tail(cfg if gated else small_grid_split(cfg, n, m, k, sms, w, gpu), n, m, k, sms, gated, gpu)


def pick_from(space, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS, small_grids: bool = True,
              gpu: GpuFacts | None = None, one_x: bool = True, whole_k: bool = True,
              one_block_split: bool = True, narrow_split: bool = True, mid_grid: bool = True) -> WsConfig:
    """``ws_config``'s pick among ``space``, before the push: ``rule_pick``, a split over 3 only where its grid runs
    more CTAs than the pick without it (the note at _SPLITS), a tile of 192 rows of W splitting K only where its tile
    of x is as wide as the pick's without it (the note at ``wide_split``), with ``one_x`` a K split of two 64-row
    blocks given way to its twin of one block and one tile of x (``one_x_twin``), with ``whole_k`` a K split of
    ``WHOLE_K_BN`` rows of x over 2 CTAs in one wave given way to the pick with K whole (``split_wide_x``), with
    ``one_block_split`` a ping-pong tile of one block and 64 rows of x, one a CTA, given way to its K split over 2
    on twice the rows of x and as many CTAs (``one_block_split_of``), with ``mid_grid`` a grid under a quarter of the
    SMs past n = 16 (a lone ping-pong tile, half) given way to a K split of more CTAs (``mid_grid_split``), with
    ``narrow_split`` one of 16-32 rows of x given way to a K split over 2 of 16-32 rows (``narrow_split_of``), then,
    with ``small_grids``, ``small_grid_split``.  Also how tools/fit_ws_rule.py picks among a table's tiles."""
    cfg = rule_pick(space, n, m, k, sms, w, gpu)
    if cfg.kc == 3:
        rest = rule_pick([c for c in space if c.kc != 3], n, m, k, sms, w, gpu)
        cfg = cfg if grid_ctas(cfg, n, m, sms) > grid_ctas(rest, n, m, sms) else rest
    if wide_split(cfg):
        rest = rule_pick([c for c in space if not wide_split(c)], n, m, k, sms, w, gpu)
        cfg = cfg if cfg.bn >= rest.bn else rest
    if one_x:
        cfg = one_x_twin(cfg, space, n)
    if whole_k and split_wide_x(cfg, n, m, sms, gpu):
        whole = [c for c in space if c.kc == 1]
        cfg = rule_pick(whole, n, m, k, sms, w, gpu) if whole else cfg
    if one_block_split:
        cfg = one_block_split_of(cfg, space, n, m, k, sms)
    if mid_grid:  # before narrow_split_of: where both would move a pick, the mid-grid split ran faster (0074)
        cfg = mid_grid_split(cfg, space, n, m, k, sms, w, gpu)
    if narrow_split:
        cfg = narrow_split_of(cfg, space, n, m, k, sms, w, gpu)
    return small_grid_split(cfg, n, m, k, sms, w, gpu) if small_grids else cfg


# A K split over 2 CTAs (WHOLE_K_MAX_KC) of 256 rows of x in a grid of one wave, where x takes WHOLE_K_MIN_X_TILES
# such tiles or more.  At n = 1024 the rule's pick was such a tile on 5 held-out layers of 896-2048 rows and K of
# 4864-11008, priced within 0.3-5% of the best tile with K whole and the same or fewer CTAs (one wave too).  In a tile
# table it ran 1.00-1.19x the time of that tile (sparse24-ws-tiles-ksplit-n1024-h200.json), and through the sweep's
# path the rule before this step took 1.01-1.21x the time on all 5 (sparse24-rule-ab-split-wide-x-h200.json,
# docs/design/0072).  On generic grids (0073, sparse24-rule-ab-split-wide-x-generic-, -pp-kc2- and -pp-kc4-h200.json):
# over 2 CTAs the split took 0.97-1.31x the time of K whole on 29 more problems (256-2048 rows, K 4864-16384,
# n = 1024-8192; median 1.16x, two under 1.0: 0.973 and 0.989); over 4 CTAs (K of 11008-16384 on 128-896 rows, where
# the pick with K whole is a 64-row ping-pong tile) it took 0.76-1.02x (median 0.86x) on 10, and stays.  Where the grid
# takes more waves (5120 rows, 320 CTAs) the split was the best tile.  The split's ring holds 5-6 steps against the
# whole-K tile's 8: a cause that tile_cost does not price, not measured apart.  At n = 256-768 (one to three tiles of
# x) K whole took 0.97-1.20x (median 1.03x) the time of the split on 10 problems: the split stays there (0073).
WHOLE_K_BN = 256
WHOLE_K_MAX_KC = 2
WHOLE_K_MIN_X_TILES = 4


def split_wide_x(cfg: WsConfig, n: int, m: int, sms: int, gpu: GpuFacts | None = None) -> bool:
    """Whether ``cfg`` splits K over 2 to ``WHOLE_K_MAX_KC`` CTAs on ``WHOLE_K_MIN_X_TILES`` or more tiles of
    ``WHOLE_K_BN`` rows of x in a grid that places in one wave."""
    return 1 < cfg.kc <= WHOLE_K_MAX_KC and cfg.bn >= WHOLE_K_BN and -(-n // cfg.bn) >= WHOLE_K_MIN_X_TILES and \
        grid_ctas(cfg, n, m, sms) <= _cluster_sms(cfg, sms, gpu)


# A K split of 64 rows of x and two 64-row blocks of W a CTA, where n takes two such tiles of x, and its twin of one
# block and one tile of x covering n (at most ONE_X_MAX_BN rows) run the same CTAs and MMAs, and tile_cost prices them
# alike.  The twin reads W from L2 once, not once a tile of x.  Its warpgroup's wgmma also takes twice the rows of x
# for the 4 KiB of W it reads from shared memory each step, whose ceiling is 1.60x dense's rate at 128 rows against
# 1.33x at 64 (docs/design/0012, 0013).  In every tile table that timed both at n = 128, the twin was faster or even:
# 0.84-1.01x the time (4096x4096, 4096x14336, 3584x3584, 3584x4096, 3072x3072, 1024x4096; H100 and H200); through
# the sweep's path (sparse24-rule-ab-one-x-*-h200.json, 2213480) the old pick took 1.000-1.122x the twin's time on the
# 20 moves (n = 120 and 128; 10 layers of the sweep set and the held-out models).  Where n takes more tiles of x
# (n = 256-512), the one-block tile lost by up to 1.12x in the tables, and 256 rows of x with one block 1.25-1.37x
# (docs/design/0068).
ONE_X_MAX_BN = 128


def one_x_twin(cfg: WsConfig, space, n: int) -> WsConfig:
    """``cfg``, or where it splits K over two 64-row blocks of W and two or more tiles of x without multicast, the
    tile of ``space`` with one block, the same split and one tile of x of ``ONE_X_MAX_BN`` rows or fewer covering n."""
    if not (cfg.kc > 1 and cfg.wm == 2 and cfg.cm == 1 and not (cfg.pp or cfg.sk) and cfg.bn < n):
        return cfg
    twins = [c for c in space if c.wm == 1 and c.cm == 1 and c.kc == cfg.kc and not (c.pp or c.sk)
             and n <= c.bn <= ONE_X_MAX_BN]
    return min(twins, key=lambda c: c.bn, default=cfg)


# A ping-pong tile of one 64-row block of W and 64 rows of x, in a grid of one tile a CTA (one wave), and the tile of
# one block, 128 rows of x and K split over 2 CTAs where it runs as many CTAs (x takes an even number of the 64-row
# tiles): the same CTAs and MMAs.  One a CTA, the ping-pong tile's second consumer warpgroup has no tile; the split's
# CTA runs half of K on twice the rows of x.  tile_cost prices the split 1-2% dearer; a tile table of the held-out
# models' layers timed it 0.88-0.93x on 2304-3072 x 2048 and 2560x2560 at n = 128 and 2048x2048 at n = 256
# (sparse24-ws-tiles-held-out-misses-h200.json, docs/design/0059, where a cost term for it moved its twins of two
# blocks onto losses).  Through the sweep's path (sparse24-rule-ab-one-block-split-*h200.json, 0073), the ping-pong
# tile took 1.011-1.086x the split's time on all 16 problems of this class (K 1536-2048, n = 120-256, median 1.035x);
# where the split runs more CTAs (x in an odd number of 64-row tiles, n = 192-704) 0.50-0.89x on 19, and with K of
# 768-1024 (each slice 6-8 steps) and as many CTAs 0.85-0.93x on 17: the class ends at ONE_BLOCK_SPLIT_MIN_K.  On 21
# of its moves on a generic grid (256-4096 rows, K 1536-2048, n = 128-1024; sparse24-rule-ab-one-block-split-generic-
# h200.json) the ping-pong tile took 0.972-1.083x the split's time, median 1.029x, 4 under 1.0 (0.972-0.999: 256-1024
# rows at n = 512-1024); eagerly 1.03-1.12x.
ONE_BLOCK_SPLIT_MIN_K = 1536


def _lone_one_block_pp(cfg: WsConfig, n: int, m: int, sms: int) -> bool:
    """Whether ``cfg`` is a ping-pong tile of one block without multicast whose grid runs one tile a CTA in one wave
    (its second consumer warpgroup idle): what ``one_block_split_of`` and ``narrow_split_of`` move, and what
    ``mid_grid_split`` moves under ``MID_GRID_PP_SHARE``."""
    n_tiles, m_tiles, _ = cfg.grid(n, m)
    return cfg.pp and cfg.wm == 1 and cfg.cm == 1 and n_tiles * m_tiles <= sms


def _one_block_k_splits(space) -> list[WsConfig]:
    """The tiles of ``space`` of one block, without multicast, splitting K (not ping-pong, not persistent): what
    ``one_block_split_of`` and ``narrow_split_of`` (over 2) and ``mid_grid_split`` (over any) move to."""
    return [c for c in space if c.kc > 1 and (c.wm, c.cm, c.pp, c.sk) == (1, 1, False, False)]


def one_block_split_of(cfg: WsConfig, space, n: int, m: int, k: int, sms: int) -> WsConfig:
    """``cfg``, or where it is a ping-pong tile of one block and 64 rows of x without multicast, one tile a CTA in
    one wave, and K is ``ONE_BLOCK_SPLIT_MIN_K`` or more, the tile of ``space`` of one block and 128 rows of x
    splitting K over 2 where it runs as many CTAs."""
    if not (cfg.bn == 64 and k >= ONE_BLOCK_SPLIT_MIN_K and _lone_one_block_pp(cfg, n, m, sms)):
        return cfg
    split = next((c for c in _one_block_k_splits(space) if (c.bn, c.kc) == (128, 2)), None)
    return split if split is not None and grid_ctas(split, n, m, sms) == grid_ctas(cfg, n, m, sms) else cfg


# A ping-pong tile of one 64-row block of W and 16-32 rows of x, one tile a CTA in one wave, past n = 16 (where the
# small-n splits end), and the least-cost tile of one block and 16-32 rows of x splitting K over 2 in one wave (as
# many CTAs, or twice as many).  A step of so few rows is latency-bound (mma_floor): halving a CTA's steps halves its
# chain, where the ping-pong tile's second consumer warpgroup has no tile.  Through the sweep's path (bench/
# sparse24_rule_ab.py; docs/design/0073, 0074) the ping-pong tile took 1.05-1.17x the split's time on all 41 problems
# first timed (sweep set, held-out models, generic: K 768-1024, n = 24-128; sparse24-rule-ab-narrow-splits-*h200.json),
# and past those bounds (-past-k-, -past-n-, -wide-k-generic-, -wide-n-generic-h200.json) 1.02-1.18x on 42 of 43
# with K of 576-1600 and n up to 512 (one even: 0.997x, 1024x576 at n = 128); with K of 512 0.97-1.02x on 7, where it
# stays.  On a generic grid (256-8192 rows, K 512-4096 in 64-column steps, n = 24-512) the class ends at K = 1728,
# and past n = 256 it is weights of 256 rows alone.
NARROW_SPLIT_K = range(576, 1729)
NARROW_SPLIT_MAX_N = 512


def narrow_split_of(cfg: WsConfig, space, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
                    gpu: GpuFacts | None = None) -> WsConfig:
    """``cfg``, or where it is a ping-pong tile of one block and 16-32 rows of x without multicast, one tile a CTA in
    one wave, at n past SPLIT_MAX_N up to NARROW_SPLIT_MAX_N and K in NARROW_SPLIT_K, the least-cost tile of
    ``space`` of one block and 16-32 rows of x splitting K over 2 whose grid places in one wave."""
    if not (cfg.bn <= 32 and SPLIT_MAX_N < n <= NARROW_SPLIT_MAX_N and k in NARROW_SPLIT_K
            and _lone_one_block_pp(cfg, n, m, sms)):
        return cfg
    splits = [c for c in _one_block_k_splits(space) if c.kc == 2 and c.bn <= 32 and grid_ctas(c, n, m, sms) <= sms]
    return rule_pick(splits, n, m, k, sms, w, gpu) if splits else cfg


# Past n = SPLIT_MAX_N, up to MID_GRID_MAX_N, a pick whose grid runs under SMALL_GRID_SHARE of the SMs, or a lone
# ping-pong tile of one block (K whole, one tile a CTA) under MID_GRID_PP_SHARE, and the least-cost K split of one
# block without multicast whose grid runs more CTAs in one wave.  In the sweep set none; held-out 2048x1536 at n = 64
# (32 lone ping-pong tiles).  tile_cost prices the split's cluster and partial sums above the SMs it adds over K's
# few steps, as at n <= 16 (the note at SMALL_GRID_SHARE).  Through the sweep's path (bench/sparse24_rule_ab.py;
# sparse24-rule-ab-mid-grid-*-h200.json, docs/design/0074), on 256-3584 rows, K 512-1536, n = 24-512:
# * under a quarter, as a candidate of any split: the pick took 1.00-1.30x the split's time on all 36 (median 1.15x),
#   eagerly 1.01-1.13x; 34 of those splits had one block;
# * under half, any split: K splits of 64 CTAs moved onto splits of 128 with x multicast ran 1.10-1.42x slower
#   (-half-), lone ping-pong tiles 1.01-1.27x faster (9 of 9): so half only for those;
# * lone ping-pong tiles under half (-pp-half-): 1.00-1.21x faster on 22 of 24; the two slower (0.93-0.94x, 3072x1280
#   at n = 24-32) were splits of two blocks, which the narrow split beat: so splits of one block only;
# * before narrow_split_of: where that step would take a lone grid under a quarter first, this split ran 1.07-1.12x
#   faster on 10 of 14 and even on 4 (-narrow-over-mid-grid-), and where this one moved the narrow split's grid
#   again, 1.08-1.18x faster on 13 of 13 (-mid-grid-after-narrow-).
MID_GRID_MAX_N = 512
MID_GRID_PP_SHARE = 0.5


def mid_grid_split(cfg: WsConfig, space, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
                   gpu: GpuFacts | None = None) -> WsConfig:
    """``cfg``, or where its grid runs under ``SMALL_GRID_SHARE`` of the SMs (a lone ping-pong tile of one block,
    under ``MID_GRID_PP_SHARE``) at n past ``SPLIT_MAX_N`` up to ``MID_GRID_MAX_N``, the least-cost tile of ``space``
    of one block without multicast splitting K whose grid runs more CTAs in one wave."""
    ctas = grid_ctas(cfg, n, m, sms)
    share = MID_GRID_PP_SHARE if cfg.kc == 1 and _lone_one_block_pp(cfg, n, m, sms) else SMALL_GRID_SHARE
    if not (SPLIT_MAX_N < n <= MID_GRID_MAX_N and ctas < share * sms):
        return cfg
    splits = [c for c in _one_block_k_splits(space) if ctas < grid_ctas(c, n, m, sms) <= _cluster_sms(c, sms, gpu)]
    return rule_pick(splits, n, m, k, sms, w, gpu) if splits else cfg


# A tile of 192 rows of W splitting K (wide_k_splits) where the pick without it has a wider tile of x: the narrower
# tile reads W from L2 once for each of its more tiles of x, and each consumer warpgroup's fragments of W serve fewer
# rows of x, neither of which tile_cost prices (docs/design/0060 section 6).  Through the sweep's path such moves ran
# slower on 4 of 8 problems, by up to 1.13x, and even on one (sparse24-rule-ab-wide-k-splits-*-h200.json, 0067).
def wide_split(cfg: WsConfig) -> bool:
    """Whether ``cfg`` is a tile of 192 rows of W with K split across its cluster (``wide_k_splits``)."""
    return cfg.wm == 3 and cfg.kc > 1


def cost_pick(n: int, m: int, k: int, sms: int, gated: bool = False, w: RuleWeights = WEIGHTS,
              gpu: GpuFacts | None = None) -> WsConfig:
    """``ws_config``'s pick before ``small_grid_split`` and the push (bench/sparse24_rule_ab.py's rule before 0064)."""
    space = [c for c in ws_candidates(n, m, k, gated=gated) if not gated or gated_tile(c)]
    return pick_from(space, n, m, k, sms, w, small_grids=False, gpu=gpu, whole_k=not gated,
                     mid_grid=not gated)  # neither timed gated


# At n <= SPLIT_MAX_N a pick whose grid runs under this share of the SMs gives way to the small-n split of the most
# CTAs in one wave (docs/design/0064).  Such grids are weights of 768-1152 rows, whose picks are a CTA a 64-row block
# and K whole: 12-18 CTAs stream the weight.  Their splits over 3 or 4 ran 1.13-1.30x faster in the small-n tables
# (sparse24-small-n-split3-h200.json, -held-out-); tile_cost prices the cluster's fixed cost over K's few steps
# (RuleWeights.cluster, fitted before the pushed sums) above the SMs the split adds.  At half the SMs the rule would
# also move grids of 36-64 CTAs, five of whose seven weights ran 1.5-10% slower split.
SMALL_GRID_SHARE = 0.25


def small_grid_split(cfg: WsConfig, n: int, m: int, k: int, sms: int, w: RuleWeights = WEIGHTS,
                     gpu: GpuFacts | None = None) -> WsConfig:
    """``cfg``, or where its grid runs under ``SMALL_GRID_SHARE`` of the SMs at n <= ``SPLIT_MAX_N``, the small-n
    split of the most CTAs that place in one wave (the least cost among those), if it runs more."""
    ctas = grid_ctas(cfg, n, m, sms)
    if ctas >= SMALL_GRID_SHARE * sms:
        return cfg
    wider = [c for c in small_n_splits(n, k) if ctas < grid_ctas(c, n, m, sms) <= _cluster_sms(c, sms, gpu)]
    return max(wider, key=lambda c: (grid_ctas(c, n, m, sms), -tile_cost(c, n, m, k, sms, w, gpu)), default=cfg)


def grid_ctas(cfg: WsConfig, n: int, m: int, sms: int) -> int:
    """The CTAs ``cfg``'s launch runs: its grid, or a ping-pong launch's one an SM, at most one a tile."""
    n_tiles, m_tiles, slices = cfg.grid(n, m)
    return min(sms, n_tiles * m_tiles) if cfg.pp else n_tiles * m_tiles * slices


def resident(cfg: WsConfig) -> int:
    """CTAs of ``cfg`` an SM holds: one where the consumers take the register file (setmaxnreg: two or three consumer
    warpgroups, or ping-pong), else as many as the SM's shared memory holds (228 KiB, 1 KiB of it the driver's a
    CTA)."""
    if CONSUMER_REGS[2 if cfg.pp else cfg.wm]:
        return 1
    return (SM_SHARED + 1024) // (cfg.shared + 1024)


# At n <= SPLIT_MAX_N a call streams its weight, and DRAM streams at its bandwidth only with its bandwidth times its
# latency in flight (Little's law).  The grid's ring holds CTAs x stages x a step's bytes; where that is short of
# the DRAM's bytes a second times RING_LATENCY_S, a deeper ring pays.  On the H200 (4.81 TB/s) the feed probe timed
# 8, 12 and 16 stages over 37 layers x n = 1, 8, 16 (sparse24-feed-probe-*-stages-h200.json, docs/design/0062, 0066):
# grids of one CTA an SM holding 6.5-8.5 MB at 8 stages ran 0.3-7% faster at 12 stages where each K slice had 22
# steps or more (53 of 53); 8.65 MB and more ran 0.99-1.06x the time.  1.7 us puts the line at 8.2 MB, under the 8.5 MB
# that gained.  K slices of 6-10 steps ran 1.00-1.03x deeper, and tiles of several CTAs an SM (one 64-row block) did
# not gain (0.97-1.04x, 19 of 21 slower), so the ring stays at 8 for both.  The H100 (3.35 TB/s) needs 5.7 MB: 0048
# read its two-block tiles at 16 stages 0.98-1.08x of 8.
RING_LATENCY_S = 1.7e-6
_DEEP_STAGES = (12, 16)
_RING_MIN_SLICE = 2  # a deeper ring only where each K slice runs at least this many rings of steps


def with_ring(cfg: WsConfig, n: int, m: int, k: int, sms: int, gpu: GpuFacts | None = None) -> WsConfig:
    """``cfg`` with the ring of ``_DEEP_STAGES`` that first holds the DRAM's bandwidth times ``RING_LATENCY_S`` in its
    grid's CTAs (or the deepest), where ``cfg``'s does not, at n <= ``SPLIT_MAX_N``, one CTA an SM, K slices of
    ``_RING_MIN_SLICE`` rings or more, and shared memory for it beside the pushed sums."""
    if n > SPLIT_MAX_N or cfg.sk or resident(cfg) > 1:
        return cfg
    facts = gpu or model_facts(sms)
    per_stage = min(grid_ctas(cfg, n, m, sms), _cluster_sms(cfg, sms, gpu)) * cfg.stage_bytes
    need = facts.dram_bytes_per_s * RING_LATENCY_S
    if cfg.stages * per_stage >= need:
        return cfg
    steps = -(-(k // 64) // cfg.kc)
    fits = [s for s in _DEEP_STAGES if steps >= _RING_MIN_SLICE * s
            and replace(cfg, stages=s)._fixed + cfg.recv_bytes <= SM_SHARED]
    reach = [s for s in fits if s * per_stage >= need]
    return replace(cfg, stages=min(reach) if reach else max(fits)) if fits else cfg


def rule_tail(cfg: WsConfig, n: int, m: int, k: int, sms: int, gated: bool = False,
              gpu: GpuFacts | None = None) -> WsConfig:
    """The rule's last steps on a picked tile: its ring (``with_ring``, not gated), then the push (``with_push``).
    Also where bench/sparse24_rule_ab.py finishes another rule's pick."""
    return with_push(cfg if gated else with_ring(cfg, n, m, k, sms, gpu), n, m, sms, gpu)


def with_push(cfg: WsConfig, n: int, m: int, sms: int, gpu: GpuFacts | None = None) -> WsConfig:
    """``cfg`` with its K slices pushing their sums where that pays (``push_pays``), else without."""
    return cfg if push_pays(cfg, n, m, sms, gpu) else replace(cfg, push=False)


def push_pays(cfg: WsConfig, n: int, m: int, sms: int, gpu: GpuFacts | None = None) -> bool:
    """Whether the pushed sums' buffer (``recv_bytes``) leaves the grid in as many waves as without it.  It can cost
    an SM a CTA: 64 clusters of 4 CTAs of 64 x 32 (4096x14336, n <= 16) ran in one wave at three CTAs an SM and
    spilled past it at two, 15-26% slower on both GPUs, where 56 of them (3584x14336) ran faster
    (sparse24-sweep-small-n-*.json at 89f5963; docs/design/0050)."""
    if not cfg.recv_bytes:
        return True
    tiles_n, blocks, slices = cfg.grid(n, m)
    at = (gpu or model_facts(sms)).at
    waves = [-(-tiles_n * blocks * slices // at(c.cm * c.kc, resident(c))) for c in (cfg, replace(cfg, push=False))]
    return waves[0] <= waves[1]


BAND = 8  # cuda/sparse24_ws.cu's KP_BAND: M groups a band of the grid's tiles
BAND_MIN_X = 24 << 20  # and its KP_BAND_MIN_X: bands where x has this many bytes or more


def band_order(n: int, k: int, tiles_n: int, groups: int) -> list[tuple[int, int]]:
    """``(tile of x, M group)`` of each CTA of a one-a-tile grid (``sparse24_ws.cu``'s ``band_tile``), in launch
    order, for x of n rows and K columns: where x has ``BAND_MIN_X`` bytes or more, bands of ``BAND`` M groups, each
    band's tiles of x one after another, so that the CTAs running at once share a few tiles of x and a few row blocks
    of W in L2; else the grid's own order, x's tiles fastest (docs/design/0038)."""
    bands = BAND if 2 * n * k >= BAND_MIN_X else 1
    out = []
    for index in range(tiles_n * groups):
        b, rest = divmod(index, bands * tiles_n)
        width = min(bands, groups - b * bands)
        out.append((rest // width, b * bands + rest % width))
    return out


def gated_tile(cfg: WsConfig) -> bool:
    """Whether a gated epilogue runs on ``cfg``: as many 64-row blocks of W from each half (``sparse24_ring.cuh``),
    one CTA a tile (``sparse24_ws.cu``) or ping-pong (``sparse24_pp.cu``), not split (``sparse24_sk.cu``).  The same
    work as the plain tile, so the rule costs it alike."""
    return cfg.wm % 2 == 0 and not cfg.sk
