"""Opt-in tile tuning of the one layout's tiled kernels (``cuda_ws``; ``cuda_sp`` where the rule runs it, at small
n): the kernel's few first tiles timed on the caller's GPU for the caller's shapes, the fastest kept where it beats
the rule's own pick.  The backend stays the rule's.

The rule (``kernels/sparse24_ws_rule.py``, ``ws_config``) picks a tile 1-3% slower than the best timed on the mean
of the tile tables (docs/design/0039), but a few layers lose 7-25% to a tile it ranks lower, and the two GPUs
disagree on some (3-4K-wide layers at n = 128: a K split wins on the H200, the ping-pong tile on the H100), which a
rule that sees the SM count cannot tell apart (docs/design/0040).  Timing decides those.  ``cuda_sp``'s rule at
small n leaves less: over the sweep set at n = 1 and 8 on an H100 tuning kept another of its tiles on 3 of 36
problems, by 1.03-1.05x (docs/design/0042).

* Nothing here runs unless asked: ``tune_tiles`` or ``kp.warmup(..., tune=True)``.  A user's first call never
  times anything.
* It chooses among tiles of the one device layout; it creates no layout.  The weights it times are synthetic
  copies of the shape (values do not change a kernel's time), enough that they are read past the L2, as in a
  model's forward; they are freed when it returns.
* Each candidate's result is checked against the rule's tile's (the agreement check of ``tuning.agreeing``)
  before any timing: a tile that disagrees never wins.
* A candidate replaces the rule's tile only where the median over rounds of the per-round ratio of their times
  is ``min_gain`` or more in its favour.  Timed again afresh, the kept tiles' gains read 0.994-1.006 of the
  tuning's reading (quartiles; extremes 0.92 and 1.08) on both GPUs (``sparse24-tile-tuning-*.json``).
* A choice holds for the run of ``N_GRAIN`` n that the tuned n is in (the rule's own grain, ``dispatch.py``); other
  n keep the rule's tile.
* Choices are stored in the plan cache (keyed by the GPU, driver and library versions, with the rule's pick of the
  day: a choice made under another rule is measured again) and applied to this process; a later process's
  ``tune_tiles`` reads them back without timing.  f16 and bf16 share a choice, as they share the rule's (the
  kernels differ only in the operand type).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import sys
from typing import Iterable

import torch

from .._checks import warn
from ..errors import InvalidProblem
from .dispatch import N_GRAIN, backend_for, layout_reason
from .layout import padded_k
from .plan import SPARSE24_EPILOGUES, gated_reason

OPS = {"cuda_ws": "sparse24_ws_tile", "cuda_sp": "sparse24_sp_tile"}  # each tuned kernel's plan-cache op
# The rule's best-ranked tiles timed.  In the full tile tables (sparse24-ws-tiles-h{100,200}.json, every tile timed,
# older kernels), a tile within 1% of the best timed is among the rule's first 6 on 86-88% of the problems; tuning
# the sweep set's worst layers over the first 16 (sparse24-tile-tuning-top16-h{100,200}.json) kept the 7th tile on
# 4 of 16 problems on the H200 (three of them 0.90-0.94x rows of dense, lifted to 0.99-1.09x) and the 10th on one
# H100 problem, none past it.
DEFAULT_TOP = 10
MIN_GAIN = 0.03
_TUNED: dict = {}  # (device index, backend, M, K, run of n, gated) -> its config: this process's choices


def run_of(n: int) -> int:
    """The run of n (``N_GRAIN`` of them) over which the rule keeps one tile: n = 8 j + 1 ... 8 j + 8 is run j."""
    return (n - 1) // N_GRAIN


def tuned_tile(device: int, n: int, m: int, k: int, gated: bool, backend: str = "cuda_ws"):
    """The tile this process tuned for ``backend`` on (M, K) at n's run on cuda:``device``, or None: the rule's
    then."""
    return _TUNED.get((device, backend, m, padded_k(k), run_of(n), gated)) if _TUNED else None


def clear_tuned_tiles() -> None:
    """Back to the rule's tiles in this process (stored choices stay in the plan cache)."""
    _TUNED.clear()
    _drop_launches()


@dataclasses.dataclass(frozen=True)
class TileChoice:
    """One tuned problem: the rule's tile, the one kept, and their median ms per call (None where read from the plan
    cache without timing, or where no tile was tuned: ``reason``)."""

    m: int
    k: int
    n: int
    gated: bool
    rule: object | None
    tile: object | None
    rule_ms: float | None = None
    tile_ms: float | None = None
    gain: float | None = None  # the median over rounds of the rule's tile's time over the kept one's (``decide``)
    source: str = "measured"  # or "stored", or "not tuned"
    reason: str | None = None
    times_ms: dict | None = None  # measured: every candidate's median ms per call, by its repr, in the rule's order


def _kernels() -> dict:
    """The kernel of each tuned backend: ``cuda_ws``'s and ``cuda_sp``'s tiles read the one layout alike."""
    from ..kernels.sparse24_sp import SpKernel
    from ..kernels.sparse24_ws import WsKernel

    return {"cuda_ws": WsKernel(), "cuda_sp": SpKernel()}


def backend_of(cfg) -> str:
    """The backend whose tile ``cfg`` is."""
    from ..kernels.sparse24_sp import SpConfig

    return "cuda_sp" if isinstance(cfg, SpConfig) else "cuda_ws"


def candidates(n: int, m: int, k: int, sms: int, gated: bool, top: int = DEFAULT_TOP,
               backend: str = "cuda_ws", gpu=None) -> list:
    """``backend``'s ``top`` first tiles for (n, M, K), the rule's own pick first: ``cuda_ws``'s in the order of its
    rule's cost (``rule_order``); ``cuda_sp``'s, whose rule has no cost to rank by, its pick's neighbours first
    (``sp_candidates``; every one of them runs a gated epilogue)."""
    if backend == "cuda_sp":
        from ..kernels.sparse24_sp import sp_candidates

        return sp_candidates(n, m, k, sms)[:top]
    from ..kernels.sparse24_ws_rule import gated_tile, rule_order, ws_candidates, ws_config

    rule = ws_config(n, m, k, sms, gated, gpu=gpu)  # first: where it drops x multicast it does not lead rule_order
    space = [c for c in ws_candidates(n, m, k) if (not gated or gated_tile(c)) and c != rule]
    return [rule, *sorted(space, key=lambda c: rule_order(c, n, m, k, sms, gpu=gpu))][:top]


def decide(rounds_ms: dict, rule, min_gain: float = MIN_GAIN) -> tuple:
    """``(tile, gain)``: the tile to keep from ``{tile: [ms per round]}`` (rounds side by side), the one whose
    median per-round ratio, rule's time over its, is largest, where that is ``1 + min_gain`` or more, else the
    rule's; and that median ratio (1.0 for the rule's)."""
    def ratio(tile) -> float:
        return statistics.median(r / t for r, t in zip(rounds_ms[rule], rounds_ms[tile]))

    best = max((t for t in rounds_ms if t != rule), key=ratio, default=rule)
    return (best, ratio(best)) if best != rule and ratio(best) >= 1 + min_gain else (rule, 1.0)


def _stored(value, rule, space):
    """A plan-cache entry's tile, if it was chosen under today's rule pick and is one of today's candidates."""
    config = type(rule)
    try:
        stored_rule, tile = config(**value["rule"]), config(**value["tile"])
    except (TypeError, KeyError, ValueError):
        return None
    return tile if stored_rule == rule and tile in space else None


def _problem(m: int, k: int, n: int, gated: bool, sms: int) -> dict:  # with the backend's op, a plan-cache key
    return {"m": m, "k": k, "run": run_of(n), "gated": gated, "sms": sms}


def _synthetic(m: int, k: int, dtype: torch.dtype, device: torch.device, copies: int) -> list:
    """``copies`` weights of M x K in the kernel's layout: a 2:4 pattern from a pruned random block, random values."""
    from ..kernels.sparse24_sp import _tiled
    from .format import compress, prune

    block = compress(prune(torch.randn(min(m, 64), k, device=device)).to(dtype))
    rows = torch.arange(m, device=device) % block.metadata.shape[0]
    return [_tiled(torch.randn(m, k // 2, device=device).to(dtype), block.metadata[rows]) for _ in range(copies)]


def tile_calls(cands: list, n: int, m: int, k: int, dtype: torch.dtype, activation: str | None, index: int) -> dict:
    """``{tile: [call per weight copy]}``: each candidate's launch (``cuda_ws``'s or ``cuda_sp``'s tiles, which read
    the one layout alike) on x of n random rows and enough synthetic copies of an M x K weight to be read past the
    L2, for the candidates whose result agrees with the first's (the rule's tile), the others left out with a
    RuntimeWarning.  The calls hold the tensors they read.  Variants not loaded yet (``compile_all`` loads many at
    once) compile at their first launch."""
    from ..activations import epilogue_columns
    from ..bench.sweep import copies_past_l2
    from ..dtypes import dtype_info
    from ..kernels import raw_stream
    from .tuning import _AGREE, disagreement

    name = dtype_info(dtype).name
    device = torch.device("cuda", index)
    kernels = _kernels()
    # As the sweep does: past twice the L2 (the layout holds 0.5625 x M x K x 2 bytes).
    copies = copies_past_l2(torch.cuda.get_device_properties(device).L2_cache_size, m * k * 9 // 8, "cold")
    weights = _synthetic(m, k, dtype, device, copies)
    x = torch.randn(n, k, device=device).to(dtype)
    y = torch.empty(n, epilogue_columns(m, activation), device=device, dtype=dtype)

    def calls(cfg) -> list:
        launch, grid = kernels[backend_of(cfg)].launch_config(cfg, n, m, name, False, activation, index)
        return [lambda p=p, c=c, x=x, y=y: launch(grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(),
                                                         n, m, k, x.stride(0), y.stride(0)), raw_stream(index))
                for p, c in weights]

    fns = {cfg: calls(cfg) for cfg in cands}
    fns[cands[0]][0]()
    want = y.clone()
    for cfg in cands[1:]:
        y.fill_(float("nan"))
        fns[cfg][0]()
        err = disagreement(y, want)
        if err > _AGREE[name]:
            warn(f"tile tuning {m}x{k} n = {n}: {cfg} left out: its result differs from the rule's tile's by "
                 f"{err:.3g} of the largest |y| (at most {_AGREE[name]:.3g} is rounding)", RuntimeWarning, stacklevel=3)
            del fns[cfg]
    return fns


def compile_all(variants, index: int) -> None:
    """Load every ``(tile, dtype name, epilogue)`` of ``variants`` on cuda:``index``, compiled by NVRTC in threads
    (it is thread-safe) or read from the kernel cache: the timing then only launches."""
    kernels = _kernels()  # launch_config loads the variant (the grid it gives for n = M = 1 is not used)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: kernels[backend_of(v[0])].launch_config(v[0], 1, 1, v[1], False, v[2], index),
                      set(variants)))


def calls_per_replay(n: int, m: int, k: int) -> int:
    """Back-to-back calls in one timed graph replay: about 1 ms of 2:4 kernels at 1 PFLOP/s, or of their weight's
    bytes at 3 TB/s where that takes longer (small n), 10 to 200 (a replay of 6 calls of 15 us read gains 3% off a
    second timing; docs/design/0041)."""
    return max(10, min(200, int(1e-3 / max(2 * m * k * n / 1e15, m * k * 9 / 8 / 3e12))))


def _measure(cands: list, n: int, m: int, k: int, dtype: torch.dtype, activation: str | None, index: int,
             rounds: int) -> dict:
    """``{tile: [ms per call, per round]}`` of the candidates that agree with the first (the rule's)."""
    from ..timing import graph_rounds

    return graph_rounds(tile_calls(cands, n, m, k, dtype, activation, index), calls_per_replay(n, m, k), rounds)


def _check(shapes, batch_sizes) -> tuple[list, list]:
    from ..activations import GATED_EPILOGUES

    sizes = sorted({int(n) for n in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise InvalidProblem(f"batch_sizes is {tuple(batch_sizes)}; give positive numbers of rows, such as (32, 128)")
    out = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) not in (2, 3):
            raise InvalidProblem(f"shape {shape}: give (M, K) or (M, K, epilogue)")
        m, k, epilogue = int(shape[0]), int(shape[1]), shape[2] if len(shape) == 3 else None
        why = None if m > 0 and k > 0 else f"M = {m}, K = {k}: not positive"
        if epilogue is not None and epilogue not in SPARSE24_EPILOGUES:
            why = why or f"epilogue {epilogue!r} is none of {sorted(SPARSE24_EPILOGUES)}"
        why = why or (gated_reason(m) if epilogue in GATED_EPILOGUES else None)
        if why:
            raise InvalidProblem(f"shape {shape}: {why}; give the (M, K) of a weight, and its epilogue, as "
                                 f"kp.sparse24.linear takes them")
        out.append((m, k, epilogue))
    return out, sizes


def tune_tiles(shapes: Iterable, batch_sizes: Iterable[int], *, device=None, dtype=torch.bfloat16,
               top: int = DEFAULT_TOP, rounds: int = 7, min_gain: float = MIN_GAIN, store: bool = True) -> list:
    """Tune the tile of the kernel the rule runs (``cuda_ws``, or ``cuda_sp`` at n <= its 64 rows) for each
    ``(M, K)`` or ``(M, K, epilogue)`` in ``shapes`` at each n in ``batch_sizes``, on ``device`` (default the current
    one), and apply the choices to this process.

    Returns one ``TileChoice`` per (shape, n), shapes in their order, n ascending: a problem the rule gives no tiled
    kernel of the layout (a dtype or K it cannot read: the Triton kernel) is returned untuned, with the reason.
    Choices read back from the plan cache are not timed again (``store=False``: neither read nor written).  Layers
    already called pick the new tiles at their next call; CUDA graphs captured before keep the kernels they recorded.
    """
    from ..activations import GATED_EPILOGUES
    from ..cache import plan_cache
    from ..dtypes import dtype_info
    from ..kernels import on_device, stream_capturing
    from ..kernels.gpu_facts import device_facts
    from ..kernels.sparse24 import sm_count

    if not torch.cuda.is_available():
        raise InvalidProblem("tile tuning times CUDA kernels; this process sees no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise InvalidProblem(f"device is {dev}; tile tuning times CUDA kernels: pass a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if top < 1 or rounds < 1 or min_gain < 0:
        raise InvalidProblem(f"top = {top}, rounds = {rounds}, min_gain = {min_gain}: top and rounds must be 1 or "
                             f"more, min_gain 0 or more")
    problems, sizes = _check(list(shapes), batch_sizes)
    name = dtype_info(dtype).name
    out = []
    with on_device(index):
        if stream_capturing():
            raise InvalidProblem("tile tuning cannot run while a CUDA graph is being captured: tune before capture")
        sms, cap = sm_count(index), torch.cuda.get_device_capability(index)
        kernels = _kernels()
        plan = []  # (m, k, epilogue, n, the rule's backend, its candidates, a stored tile or None, its gain)
        for m, k, epilogue in problems:
            gated, held = epilogue in GATED_EPILOGUES, padded_k(k)
            for n in sizes:
                backend = backend_for(cap, n, m, k, name)
                if backend not in OPS or n > kernels[backend].max_n:
                    plan.append((m, k, epilogue, n, backend, None, None, None))
                    continue
                gpu = device_facts(index) if backend == "cuda_ws" else None
                # A K the layout pads runs the tiles of its padded K (layout.padded_k): those are timed and kept.
                cands = candidates(n, m, held, sms, gated, top, backend, gpu)
                value = (plan_cache().get(OPS[backend], _problem(m, held, n, gated, sms), device=f"cuda:{index}")
                         if store else None)
                tile = _stored(value, cands[0], cands) if value is not None else None
                gain = value.get("gain") if tile is not None else None
                plan.append((m, k, epilogue, n, backend, cands, tile,
                             float(gain) if isinstance(gain, (int, float)) else None))
        compile_all([(c, name, e) for _, _, e, _, _, cands, tile, _ in plan if cands and tile is None for c in cands],
                    index)
        for m, k, epilogue, n, backend, cands, tile, stored_gain in plan:
            gated = epilogue in GATED_EPILOGUES
            if cands is None:
                why = layout_reason(cap, k, name) or f"n = {n}: in chunks of {kernels[backend].max_n} rows"
                out.append(TileChoice(m, k, n, gated, None, None, source="not tuned",
                                      reason=f"the rule runs {backend} here ({why}), no tile tuned"))
                continue
            held = padded_k(k)
            rule, problem = cands[0], _problem(m, held, n, gated, sms)
            if tile is not None:
                choice = TileChoice(m, k, n, gated, rule, tile, gain=stored_gain, source="stored")
            else:
                times = _measure(cands, n, m, held, dtype, epilogue, index, rounds)
                tile, gain = decide(times, rule, min_gain)
                ms = {str(c): statistics.median(t) for c, t in times.items()}
                choice = TileChoice(m, k, n, gated, rule, tile, ms[str(rule)], ms[str(tile)], gain, times_ms=ms)
                if store:
                    plan_cache().put(OPS[backend], problem, {"rule": dataclasses.asdict(rule),
                                                             "tile": dataclasses.asdict(tile), "dtype": name,
                                                             "gain": gain, "ms": ms}, device=f"cuda:{index}")
            _TUNED[(index, backend, m, held, run_of(n), gated)] = tile
            out.append(choice)
    _drop_launches()
    return out


def _drop_launches() -> None:
    """Every weight's prepared launches, so that its next call looks its tile up again (``sparse24_mma``).  A
    process that never imported that module prepared none."""
    mma = sys.modules.get(f"{__package__.rpartition('.')[0]}.kernels.sparse24_mma")
    if mma is not None:
        mma.drop_launches()


def table(choices: list) -> str:
    """The choices as text: shape, n, the rule's tile, the tile kept, the gain."""
    lines = [f"{'M x K':>13} {'n':>6}  {'kept':<8} {'gain':>6}  tile"]
    for c in choices:
        if c.tile is None:
            lines.append(f"{c.m:>6} x {c.k:<5} {c.n:>6}  {'-':<8} {'-':>6}  {c.reason}")
            continue
        kept = "rule" if c.tile == c.rule else "other"
        gain = f"{c.gain:.3f}" if c.gain is not None else c.source
        lines.append(f"{c.m:>6} x {c.k:<5} {c.n:>6}  {kept:<8} {gain:>6}  {c.tile}" +
                     (f" (rule: {c.rule})" if kept == "other" else ""))
    return "\n".join(lines)


__all__ = ["TileChoice", "tune_tiles", "tuned_tile", "clear_tuned_tiles", "candidates", "decide", "table", "run_of"]
