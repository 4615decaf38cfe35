"""The "fast" memory policy's tuning: every candidate backend timed on the caller's tensors, once per bucket.

Under memory="fast" the functional path (``gemm.py``) calls ``tune`` at the first
call of each (device, M, K, N bucket, dtype, epilogue) on CUDA, outside graph
capture; the fastest backend is stored in the plan cache.  The default,
memory="compact", never comes here (``dispatch.py``'s rule picks).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .._checks import warn
from ..errors import InvalidProblem, KernelPlanError
from ..kernels import on_device
from .plan import GemmSparse24Descriptor, GemmSparse24Plan


_seen_buckets: set = set()


def first_of_its_bucket(desc: GemmSparse24Descriptor) -> bool:
    """True once per dispatch bucket that has several candidates and no stored measurement."""
    if desc in _seen_buckets:  # the hot path: one set lookup
        return False
    key = tuple(GemmSparse24Plan.dispatch_key(desc).items())
    if key in _seen_buckets:
        _seen_buckets.add(desc)
        return False
    _seen_buckets.update((key, desc))
    return len(tunable(desc)) > 1 and GemmSparse24Plan.measured(desc) is None


def tunable(desc: GemmSparse24Descriptor) -> list:
    """The candidates tuning times: not the reference, nor backends that run by name only."""
    return [b for b in GemmSparse24Plan.candidates(desc) if b.name != "reference" and b.priority_for(desc) >= 0]


def measure(fns: dict[str, Callable], bench: Callable, what: str) -> dict:
    """``{name: median}``: three rounds in alternating orders, each function keeping its median.

    ``bench(fn)`` returns seconds, or a tuple of them (kernel, host): a tuple's
    median is taken per element.  The first timing of a process can run at
    other clocks than the next, and a call near the host-bound edge can be
    lucky once: neither may decide alone (on an H200, a 2:4 path chosen on one
    fast round measured 0.82x of dense afterwards).  A function whose library
    refuses the problem at run time (a KernelPlanError) is left out with a
    RuntimeWarning.
    """
    live = dict(fns)
    times: dict[str, list] = {name: [] for name in fns}
    for order in (list(fns), list(fns)[::-1], list(fns)):
        for name in order:
            if name not in live:
                continue
            try:
                times[name].append(bench(live[name]))
            except KernelPlanError as e:
                warn(f"{what}: backend {name} left out: {e}", RuntimeWarning, stacklevel=3)
                del live[name]

    def median(samples: list):
        if isinstance(samples[0], tuple):
            return tuple(median(list(column)) for column in zip(*samples))
        return sorted(samples)[len(samples) // 2]

    return {name: median(t) for name, t in times.items() if name in live}


def tune(desc, call: Callable, *, warmup_ms: float = 10.0, rep_ms: float = 25.0) -> str:
    """Time every GPU candidate and remember the fastest, for eager calls and for graphs; return the eager one.

    ``call(plan)`` returns a no-argument function that runs one whole call
    through ``plan`` (outputs written).  For eager calls a candidate's time is
    the larger of its kernels' time (``do_bench``, L2 flushed between calls)
    and its wall time per call in a back-to-back loop, read side by side with
    the other candidates', which is its host work wherever that is longer:
    ``do_bench`` alone hides host work behind its cache flush, and picked a
    Triton path of 57 us host work over dense's 23 us on an H200 for kernels
    of 20-40 us, a loss wherever the host is the bound (decode).  For the same
    problem recorded into a CUDA graph (``desc.graph``), whose replays cost no
    host time, the kernels' time alone decides: on an H200 the host criterion
    kept 2:4 decode of a Llama replayed as a graph on dense at n = 1 for every
    projection but the LM head.  Backends of negative priority (the Triton
    kernel on CPU, which is the interpreter) run by name only and are not
    timed.  Before any timing, each candidate's result is checked against the
    dense floor's (``agreeing``): a backend that computes a wrong answer never
    wins on speed.
    """
    if not desc.device.startswith("cuda"):
        raise InvalidProblem(f"descriptor.device is {desc.device}; tuning measures CUDA kernels only")
    # do_bench's events, cache flush and synchronize are the current device's: make it desc's.
    with on_device(torch.device(desc.device).index):
        return _tune(desc, call, warmup_ms, rep_ms)


def _tune(desc, call: Callable, warmup_ms: float, rep_ms: float) -> str:
    import triton.testing

    candidates = tunable(desc) or GemmSparse24Plan.candidates(desc)
    fns = {b.name: call(GemmSparse24Plan(desc, b)) for b in candidates}
    what = f"tuning {desc}"
    # The dense floor is the oracle: cuBLAS on the decompressed weight.  Where it cannot run (f64 on
    # CUDA), the reference backend is.
    oracle = fns.get("dense") or call(GemmSparse24Plan(desc, GemmSparse24Plan.registry.get("reference")))
    fns = agreeing(fns, oracle, _AGREE[desc.dtype], what)

    from ..timing import host_us_side_by_side

    def kernels_and_host(fns: dict[str, Callable]) -> dict[str, tuple[float, float]]:
        """{name: (kernel seconds, host-inclusive seconds per back-to-back call)}, refusals left out."""
        kernels = measure(fns, lambda fn: triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                                                  return_mode="median") * 1e-3, what)
        # The host is timed apart from the kernels, in short bursts that alternate between the
        # candidates: slow spells of the host last tens to hundreds of ms and slow every candidate
        # alike, so only a side-by-side reading compares them.  Timed one after another between
        # do_bench runs, cuda_mma's 13 us of host work once read 18.9 us against dense's 18.7 us
        # kernels, and dense kept f16 4096^2 n = 1 and 8 at 1.00x where cuda_mma runs at 1.67x
        # (H200 at 706c130, bench/results/sparse24-h200-f16.json).  Read in 12 alternating bursts
        # there, every candidate slowed 1.5x together for 4 of them, and the medians kept the order.
        host = host_us_side_by_side({name: fns[name] for name in kernels}, torch.device(desc.device),
                                    calls=25, rounds=9)
        return {name: (kernels[name], host[name] * 1e-6) for name in kernels}

    criteria = {True: lambda kernel, host: kernel, False: max}  # by desc.graph
    both = kernels_and_host(fns)
    repeats: dict[str, dict] = {}  # by challenger: one repeat serves both criteria

    def again(floor: str, challenger: str) -> dict:
        if challenger not in repeats:
            repeats[challenger] = kernels_and_host({floor: fns[floor], challenger: fns[challenger]})
        return repeats[challenger]

    chosen = {}
    for graph, criterion in criteria.items():
        timings = {name: criterion(*t) for name, t in both.items()}
        # The dense floor stays unless another backend beats it by 3%, twice: on an H200 a 1-5% tuning
        # win at ~20 us was repeatedly a loss when measured again (bench/results/sparse24-h200.json).
        timings = confirmed(timings, lambda f, c, crit=criterion: {n: crit(*t) for n, t in again(f, c).items()},
                            floor="dense", margin=0.03)
        # Where the host work bounds the eager calls, candidates' host-inclusive times tie within noise
        # (H200 at 290f9be, 4096^2 n = 16: cuda_sp's 15.9 us kernels won the tie over cuda_mma's 11.9 us):
        # their kernels' time decides then, which is what a caller bound by the GPU sees.
        ties = None if graph else {name: t[0] for name, t in both.items()}
        chosen[graph] = GemmSparse24Plan.remember_fastest(dataclasses.replace(desc, graph=graph), timings,
                                                          floor="dense", margin=0.03, ties=ties)
    return chosen[False]


# How far a candidate's result may sit from the oracle's, as a fraction of the oracle's largest
# magnitude: a few units in the last place of the output dtype.  Each side rounds its result once, a
# K split rounds its partials too, and f32 may multiply in TF32.  The wrong results met so far sat
# orders of magnitude above: a stale cuSPARSELt copy gave a relative error of 1.0-1.4 (f16, H200).
# f64 runs on the reference alone, checked against itself.
_AGREE = {"bf16": 2.0**-5, "f16": 2.0**-8, "f32": 2.0**-8, "f64": 2.0**-40}


def agreeing(fns: dict[str, Callable], oracle: Callable, tol: float, what: str) -> dict[str, Callable]:
    """``fns`` less those whose result disagrees with ``oracle()``'s by more than ``tol``, each with a RuntimeWarning.

    Every function runs once, on the caller's inputs.  A function whose library
    refuses the problem (a KernelPlanError) is kept: ``measure`` reports it.
    """
    want = oracle()
    kept = {}
    for name, fn in fns.items():
        if fn is oracle:
            kept[name] = fn
            continue
        try:
            got = fn()
        except KernelPlanError:
            kept[name] = fn
            continue
        err = disagreement(got, want)
        if err <= tol:
            kept[name] = fn
        else:
            warn(f"{what}: backend {name} left out: its result differs from the oracle's by {err:.3g} of the "
                 f"largest |y| (at most {tol:.3g} is rounding)", RuntimeWarning, stacklevel=3)
    return kept


def disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over ``want``'s finite elements, as a fraction of their largest |want|.

    Infinite where the two are non-finite in different places, or where they
    differ at all and ``want`` is all zeros.  Computed in the tensors' own
    dtype, so that a large output costs no fp32 copies.
    """
    finite = torch.isfinite(want)
    if got.shape != want.shape or not torch.equal(torch.isfinite(got), finite):
        return float("inf")
    if not finite.all():
        got, want = got[finite], want[finite]
    if want.numel() == 0:
        return 0.0
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


def confirmed(timings: dict[str, float], again: Callable[[str, str], dict], *,
              floor: str, margin: float) -> dict[str, float]:
    """``timings`` after every backend that beat ``floor`` by ``margin`` was measured against it again.

    ``again(floor, challenger)`` times the two anew, side by side (``{name:
    seconds}``, a name left out where its library refused).  A win must hold in
    both measurements: the challenger keeps the worse of its two ratios to the
    floor, each taken within one measurement, so a slow spell of the host that
    slows both in the repeat does not count against the challenger alone.  One
    run won by ``triton_bfe`` at 0.97x of dense measured 0.85x of dense right
    after (H100, f16 4096^2, n = 64, bench/results/sparse24-h100.json).  A
    challenger that fails its repeat makes way for the next; each is repeated
    at most once.
    """
    timings, repeated = dict(timings), set()
    while floor in timings:
        best = min(timings, key=timings.get)
        if best == floor or best in repeated or timings[best] > (1 - margin) * timings[floor]:
            break
        repeated.add(best)
        repeat = again(floor, best)
        if best not in repeat:
            timings[best] = float("inf")
        elif floor in repeat:
            timings[best] = timings[floor] * max(timings[best] / timings[floor], repeat[best] / repeat[floor])
        else:
            timings[best] = max(timings[best], repeat[best])
    return timings
