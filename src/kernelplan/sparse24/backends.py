"""GPU backends of the 2:4 linear and the measurement that picks between them.

* ``triton``, ``triton_bfe``, ``triton_m128``: ``kernels/sparse24.py``, the
  compressed tile expanded in registers (two expansion cuts, two tile shapes);
* ``cuda_mma``: CUDA C++ for n <= 16 (``kernels/sparse24_mma.py``), dense MMAs on
  a tiled copy of the weight;
* ``cuda_sp``: CUDA C++ for n <= 64 on the sparse tensor cores (``mma.sp``,
  ``kernels/sparse24_sp.py``), reading the one device layout;
* ``cuda_wg``: Hopper ``wgmma.sp`` (``kernels/sparse24_wg.py``) on the same layout;
* ``cuda_ws``: the same instruction, warp-specialized with TMA copies (``kernels/sparse24_ws.py``);
* ``cusparselt``: cuSPARSELt through nvmath-python (``cusparselt.py``), for large N;
* ``dense``: the weight decompressed once (cached with it) and a cuBLAS GEMM:
  the floor that keeps dispatch from ever losing to dense, at the price of
  a dense copy of each weight it is chosen for.

What each measured is in ``bench/results/sparse24-*.json`` (the README's table) and the
decision records ``docs/design/0001``, ``0002``.

By default (memory="compact") the rule of ``dispatch.py`` picks among the
kernels of the one layout and nothing is timed.  Under memory="fast", ``tune``
times every candidate on the caller's tensors and stores the fastest per
(device, M, K, N bucket, dtype, epilogue) in the plan cache; the functional path
calls it once per bucket, on CUDA, outside graph capture.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from ..activations import ACTIVATIONS
from ..dtypes import dtype_info
from ..errors import InvalidProblem, KernelPlanError
from ..kernels import on_device, triton_reason
from ..plan import Backend, PrecisionGuarantee
from .cusparselt import CusparseLtSparse24Backend
from .format import derived_from
from .layout import PUBLIC, SP_LAYOUT
from .gemm import GemmSparse24Args, GemmSparse24Plan, tunable

GPU_DTYPES = ("f32", "f16", "bf16")


def _sm_count(device: str) -> int:
    from ..kernels.sparse24 import sm_count

    dev = torch.device(device)
    return sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 4


@functools.lru_cache(maxsize=4096)
def _triton_config(desc, bfe: bool, wide: bool = False):  # per call, so memoised: the device lookup is microseconds
    from ..kernels.sparse24 import config_for

    return config_for(desc.n, desc.m, desc.k, _sm_count(desc.device), dtype_info(desc.dtype).itemsize, bfe=bfe,
                      wide=wide)


class TritonSparse24Backend(Backend):
    name = "triton"
    # Timed by tuning on CUDA, below the dense floor when nothing is measured: its lead over
    # dense depends on the shape (1.05x at 4096x4096, up to 1.2x at 28672x8192 on an H200).
    # On CPU it is the interpreter, a test tool: by name only.
    priority = 1
    bfe = False  # how the expansion cuts each group's code out (kernels/sparse24.py, _EXPAND_BFE)
    wide = False  # 128-row tiles at N tiles of 32 and 64 (kernels/sparse24.py, _wide_config)

    def priority_for(self, desc) -> int:
        return self.priority if desc.device.startswith("cuda") else -1

    def supports(self, desc) -> str | None:
        if desc.dtype not in GPU_DTYPES:
            return f"dtype {desc.dtype} is not one of {GPU_DTYPES}"
        if desc.k % 64:
            return f"K = {desc.k} is not a multiple of 64, the kernel's smallest K tile"
        if desc.dtype == "bf16" and not desc.device.startswith("cuda"):
            # Measured: results off by ~1e9 through the interpreter, whose bf16 arithmetic is wrong.
            return "dtype bf16 on CPU: the Triton interpreter computes bf16 arithmetic wrongly; use f32 or f16 there"
        return triton_reason(desc.device)

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            "f32" if desc.dtype == "f32" else desc.dtype, "f32", deterministic=True, bit_stable=False,
            note="fp32 accumulation; K is split by shape (a fixed order per shape), so bits can change with N",
        )

    def _config(self, desc):
        return _triton_config(desc, self.bfe, self.wide)

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        from ..kernels.sparse24 import launch

        # No plan workspace: a K split keeps its partials in a per-stream scratch (split_scratch).
        launch(args.x, args.values, args.metadata, args.bias, args.y, desc.activation, self._config(desc))

    def bind(self, desc):
        from ..kernels.sparse24 import BoundLinear

        return BoundLinear(self._config(desc), desc.activation, desc.graph)


class TritonBfeSparse24Backend(TritonSparse24Backend):
    """The same kernel, each group's code cut out by ``bfe``: a tuning candidate beside ``triton``.

    Neither cut has won everywhere (``kernels/sparse24.py``, ``_EXPAND_BFE``).
    With the previous group codes, on an H100 bfe ran 8192x28672 at n <= 16 at
    1.50x of dense against 1.24x, on an H200 it ran 28672x8192 at 1.13x against
    1.34x; with the present ones the two are within a few percent on an H200.
    """

    name = "triton_bfe"
    bfe = True

    def supports(self, desc) -> str | None:
        if desc.dtype == "f32":
            return "dtype f32: 32-bit weights are expanded by selects, not PRMT; the kernel is triton's"
        return super().supports(desc)


class TritonWideSparse24Backend(TritonSparse24Backend):
    """The same kernel on 128-row tiles with more K splits, for n > 16: a tuning candidate.

    On an H200 it ran the Llama-70B shapes at n = 32 and 64 at 1.12-1.33x of
    dense where ``triton``'s 64-row tiles gave 0.90-1.19x; on an H100 the 64-row
    tiles were the sweep's best (``kernels/sparse24.py``, ``_wide_config``).
    """

    name = "triton_m128"
    wide = True

    def supports(self, desc) -> str | None:
        if desc.n <= 16:
            return f"n = {desc.n} runs 16-wide N tiles; 128-row tiles are a candidate for n > 16"
        if desc.k % 128:
            return f"K = {desc.k} is not a multiple of 128, the K tile of 128-row tiles"
        if desc.dtype == "f32":
            return "dtype f32: 128-row tiles of 32-bit weights overflow shared memory; the kernel is triton's"
        return super().supports(desc)


class CudaMmaSparse24Backend(Backend):
    """CUDA C++ for N <= 16 (``kernels/sparse24_mma.py``): operands straight into MMA registers, weight tiled.

    On an H200 (bf16, the Llama 8B and 70B shapes and the 128256x4096 LM
    head) it ran n = 1 at 1.59-1.79x of dense and n = 16 at 1.52-1.69x, where
    the Triton kernel gave 1.31-1.43x.  Its price: a tiled copy of the values
    and codes kept with each weight it runs.  A tuning candidate on CUDA.
    """

    name = "cuda_mma"
    priority = 1
    what = "two 8-wide MMA tiles"
    max_n = 16  # kernels/sparse24_mma.py MAX_N; here so that supports() imports no kernel module
    chunks = False  # more rows of x than max_n run in chunks (kernels/sparse24_mma.py, MmaLinear.launch)

    def kernel(self):
        from ..kernels.sparse24_mma import TiledKernel

        return TiledKernel()

    def supports(self, desc) -> str | None:
        from ..kernels.nvrtc import nvrtc_reason

        if desc.dtype not in ("f16", "bf16"):
            return f"dtype {desc.dtype}: the kernel multiplies f16 and bf16 on the tensor cores"
        if desc.n > self.max_n and not self.chunks:
            return f"n = {desc.n}: the kernel takes at most {self.max_n} rows of x ({self.what})"
        if desc.k % 64:
            return f"K = {desc.k} is not a multiple of 64, the kernel's K step"
        why = nvrtc_reason(desc.device)
        if why is None and torch.cuda.get_device_capability(torch.device(desc.device)) < (8, 0):
            return f"device {desc.device}: bf16 MMA (mma.sync, mma.sp) needs compute capability 8.0 or newer"
        return why

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(desc.dtype, "f32", deterministic=True, bit_stable=False,
                                  note="fp32 accumulation; K slices per CTA chosen by shape, summed in a fixed order")

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        self.bind(desc).launch(args.x, args.values, args.metadata, args.bias, args.y)

    def bound(self, desc, args: GemmSparse24Args):
        """``run(desc, args, None)`` resolved once, or None (``MmaLinear.bound``)."""
        return self.bind(desc).bound(args.x, args.values, args.metadata, args.bias, args.y)

    def bind(self, desc):
        from ..kernels.sparse24_mma import MmaLinear

        return MmaLinear(desc.activation, self.kernel())


class CudaSpSparse24Backend(CudaMmaSparse24Backend):
    """CUDA C++ for N <= 64 on the sparse tensor cores (``kernels/sparse24_sp.py``): ``mma.sp``, x staged per CTA.

    The values and positions go to the tensor cores as stored, in the one
    device layout (``sparse24/layout.py``): read as held where the weight is
    held in it (``Sparse24Linear``), else derived once beside the public
    format.  Both operands are staged in shared memory by cp.async.  The
    rule's kernel at n <= 16 on Hopper and at every n on Ampere and Ada
    (``dispatch.py``); what it measured is in ``bench/results/sparse24-sweep-*.json``.
    """

    name = "cuda_sp"
    layouts = (PUBLIC, SP_LAYOUT)  # reads a weight held in the device layout as it is, or derives it
    what = "eight 8-wide sparse MMA tiles"
    max_n = 64  # kernels/sparse24_sp.py MAX_N
    chunks = True

    def priority_for(self, desc) -> int:
        # A tuning candidate (memory="fast") up to its widest tile; past it, chunks of x re-read W: by rule only.
        return self.priority if desc.n <= self.max_n else -1

    def kernel(self):
        from ..kernels.sparse24_sp import SpKernel

        return SpKernel()


class CudaWgSparse24Backend(CudaMmaSparse24Backend):
    """CUDA C++ on Hopper's sparse warpgroup MMA (``wgmma.mma_async.sp``, ``kernels/sparse24_wg.py``), any N.

    Reads the layout of ``cuda_sp`` (one copy shared by both, 0.5625x of the
    dense bytes); x staged in wgmma's swizzled layout by cp.async.  sm_90a only.
    Superseded in the rule by ``cuda_ws`` (docs/design/0005); available by name
    and a tuning candidate under memory="fast".
    """

    name = "cuda_wg"
    layouts = (PUBLIC, SP_LAYOUT)
    what = "wgmma.sp N tiles"
    max_n = 1 << 31

    def kernel(self):
        from ..kernels.sparse24_wg import WgKernel

        return WgKernel()

    def supports(self, desc) -> str | None:
        why = super().supports(desc)
        if why is None and torch.cuda.get_device_capability(torch.device(desc.device)) != (9, 0):
            return f"device {desc.device}: wgmma.mma_async.sp is an sm_90a (Hopper) instruction"
        return why


class CudaWsSparse24Backend(CudaWgSparse24Backend):
    """``wgmma.mma_async.sp`` warp-specialized (``kernels/sparse24_ws.py``): a producer warp copies through the
    copy engine (TMA), consumer warpgroups multiply, mbarriers between; K split across a CTA cluster.

    Reads the one layout, as ``cuda_wg`` does.  sm_90a only.  The rule's kernel past
    n = 16 on Hopper (``dispatch.py``).
    """

    name = "cuda_ws"
    what = "warp-specialized wgmma.sp tiles"

    def kernel(self):
        from ..kernels.sparse24_ws import WsKernel

        return WsKernel()


def _dense_weight(values: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    from .format import Sparse24Weight

    return Sparse24Weight(values.detach(), metadata, _validate=False).decompress()


class DenseSparse24Backend(Backend):
    name = "dense"
    priority = 5

    def supports(self, desc) -> str | None:
        if desc.dtype not in GPU_DTYPES:
            return f"dtype {desc.dtype} is not one of {GPU_DTYPES}"
        if not desc.device.startswith("cuda"):
            return f"device {desc.device}: the dense floor is for CUDA; the reference is the CPU path"
        return None

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            "tf32" if desc.dtype == "f32" and torch.backends.cuda.matmul.allow_tf32 else desc.dtype,
            "f32", deterministic=True, bit_stable=False,
            note="cuBLAS through F.linear on a cached dense copy of the weight; f16 may reduce in f16 "
            "when torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is set",
        )

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        w = derived_from(args.values, args.metadata, "dense", _dense_weight)
        # Straight into y: F.linear's own output and a copy would cost one more pass over y.
        if args.bias is None:
            torch.mm(args.x, w.t(), out=args.y)
        else:
            torch.addmm(args.bias, args.x, w.t(), out=args.y)
        if desc.activation:
            args.y.copy_(ACTIVATIONS[desc.activation].fn(args.y.float()))

    def bind(self, desc):
        # F.linear, as nn.Linear calls it: on a host-bound call it costs what the dense model's layer costs.
        act = ACTIVATIONS[desc.activation].fn if desc.activation else None

        def call(x, values, metadata, bias):
            y = F.linear(x, derived_from(values, metadata, "dense", _dense_weight), bias)
            return y if act is None else y.copy_(act(y.float()))

        return call


GemmSparse24Plan.registry.register(TritonSparse24Backend())
GemmSparse24Plan.registry.register(TritonBfeSparse24Backend())
GemmSparse24Plan.registry.register(TritonWideSparse24Backend())
GemmSparse24Plan.registry.register(CudaMmaSparse24Backend())
GemmSparse24Plan.registry.register(CudaSpSparse24Backend())
GemmSparse24Plan.registry.register(CudaWgSparse24Backend())
GemmSparse24Plan.registry.register(CudaWsSparse24Backend())
GemmSparse24Plan.registry.register(DenseSparse24Backend())
GemmSparse24Plan.registry.register(CusparseLtSparse24Backend())


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
                warnings.warn(f"{what}: backend {name} left out: {e}", RuntimeWarning, stacklevel=3)
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
            warnings.warn(f"{what}: backend {name} left out: its result differs from the oracle's by {err:.3g} "
                          f"of the largest |y| (at most {tol:.3g} is rounding)", RuntimeWarning, stacklevel=3)
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
