"""Host time per call: what a small problem costs on the CPU side of a launch (tuning and the benchmarks); and the
device time of each kernel a call launches."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # dev's own queue, whichever device is current


def host_us_per_call(fn: Callable, dev: torch.device, calls: int, *, wait: bool = True) -> float:
    """Wall time per call of ``calls`` back-to-back calls, after a warm-up.

    With ``wait`` the clock stops once the device has finished: the larger of
    the host work and the device time.  Without it the clock stops when the
    last call returns, so it reads the host work alone even where the kernels
    are longer; ``calls`` must then stay well under the launch queue's depth
    (about a thousand launches), or the host stalls on a full queue.
    """
    for _ in range(max(calls // 10, 1)):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        _sync(dev)
    elapsed = time.perf_counter() - t0
    _sync(dev)
    return elapsed / calls * 1e6


def wall_seconds(fn: Callable) -> float:
    """Wall time of one call of ``fn`` on the GPU, its work finished: synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(samplers: dict[str, Callable[[], float]], rounds: int, per_round: int = 1) -> dict[str, float]:
    """The median of each sampler's readings, taken in rounds that alternate between the samplers.

    Time on the GPU machines drifts and jumps: one H100 host gave F.linear 22 and then 24 µs,
    and torch.empty 5.6 and then 15 µs, in back-to-back rounds, and ran the same dense Llama
    ``generate()`` at 3.6 and at 7.5 ms per token minutes apart.  Rounds that alternate expose
    every sampler to the same drift, and the median drops the jumps; each round starts one sampler later, so
    no sampler always runs first.  The garbage collector is
    paused while timing, as ``timeit`` does: with transformers imported a process holds ~350k
    objects, and a collection of them (160 ms on a CI machine) lands in whichever call
    happens to trigger it.
    """
    samples: dict[str, list[float]] = {name: [] for name in samplers}
    gc.collect()
    paused = gc.isenabled()
    gc.disable()
    try:
        names = list(samplers)
        for r in range(rounds):
            # Each round starts one sampler later: a host-bound step read 1.4x slower in the first two places of a
            # fixed order than in the last two (sparse24-model on an H200, 0024).
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples[name] += [samplers[name]() for _ in range(per_round)]
    finally:
        if paused:
            gc.enable()
    return {name: statistics.median(s) for name, s in samples.items()}


def host_us_side_by_side(fns: dict[str, Callable], dev: torch.device, calls: int, rounds: int = 7) -> dict[str, float]:
    """``host_us_per_call`` of each of ``fns``, in ``interleaved`` rounds."""
    return interleaved({name: lambda fn=fn: host_us_per_call(fn, dev, calls) for name, fn in fns.items()}, rounds)


def host_report(fns: dict[str, Callable], dev: torch.device, calls: int = 200, rounds: int = 15) -> dict:
    """Per call of each of ``fns``, side by side: ``host_us`` (host work alone) and ``wall_us`` (back to back, waited for).

    Both are medians of ``interleaved`` rounds.  ``wall_us`` is the larger of
    the host work and the device time; ``host_us`` is what the issue budgets.
    """
    host = interleaved({name: lambda fn=fn: host_us_per_call(fn, dev, calls, wait=False) for name, fn in fns.items()},
                       rounds)
    wall = host_us_side_by_side(fns, dev, 2 * calls, rounds=max(rounds // 3, 3))
    return {"host_us": host, "wall_us": wall}


def host_report_line(report: dict, where: str) -> str:
    """One printed line of a ``host_report`` of kernelplan against F.linear at ``where``."""
    host, wall = report["host_us"], report["wall_us"]
    return (f"per call at {where}: host work kernelplan {host['kernelplan']:.1f} us, F.linear {host['F.linear']:.1f} us; "
            f"back to back, waited for: {wall['kernelplan']:.1f} us, {wall['F.linear']:.1f} us")


def profiled_calls(fn: Callable, calls: int, cpu: bool = False):
    """``torch.profiler``'s record (CUPTI's kernels; with ``cpu``, the host's ops instead) of ``calls`` back-to-back
    calls of ``fn``, after one call unprofiled."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_device_ms(fn: Callable, calls: int) -> dict[str, float]:
    """Device ms per call of ``fn`` in each kernel it launches, by kernel name: CUPTI's durations under
    ``torch.profiler`` over ``calls`` calls, after one call unprofiled."""
    prof = profiled_calls(fn, calls)
    return {ev.key: ev.self_device_time_total / calls / 1e3 for ev in prof.key_averages()
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total}


def by_short_name(ms: dict[str, float], chars: int) -> dict[str, float]:
    """``kernel_device_ms``'s times by name cut to ``chars`` characters, summed where cut names meet (inductor's kernel
    names start alike: a dict of cut names built by assignment kept the last such kernel's time alone)."""
    short: dict[str, float] = {}
    for name, t in ms.items():
        short[name[:chars]] = short.get(name[:chars], 0.0) + t
    return short


def capture(graph: "torch.cuda.CUDAGraph"):
    """``torch.cuda.graph(graph)`` on a new stream of the current device.

    Never on torch's default capture stream: that one is made once per process, on the device current at the first
    capture that names no stream, and taken by every such capture after it.  A capture of ours on cuda:1 made first
    would leave every later default capture on cuda:0, the user's own included, recording on cuda:1's stream: an
    empty graph.  And a timing of ours after a user's first capture on another device would time empty graphs
    (docs/design/0047)."""
    return torch.cuda.graph(graph, stream=torch.cuda.Stream())


@contextlib.contextmanager
def default_capture_stream_here():
    """For a capture that names no stream and is not ours to change (``triton.testing.do_bench_cudagraph``): torch's
    default capture stream is a new stream of the current device while it runs, and what it was after (``capture``
    says why)."""
    before = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    try:
        yield
    finally:
        torch.cuda.graph.default_capture_stream = before


def graph_us(fn: Callable, rep: int = 20) -> float:
    """Microseconds of ``fn`` replayed as a CUDA graph, the median (``triton.testing.do_bench_cudagraph``, on the
    current device): the kernels' time, no host work."""
    import triton

    with default_capture_stream_here():
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def graph_rounds(fns: dict[str, list[Callable]], calls: int, rounds: int) -> dict[str, list[float]]:
    """ms per call of each of ``fns``' lists, per round: ``calls`` back-to-back calls cycling over the list (one
    weight copy each, so the weights are read past the L2), captured once as a CUDA graph and replayed, in rounds
    whose order alternates (forwards, then backwards), so that a slow spell of the GPU lands on all alike.  No host
    work is timed."""
    graphs = {}
    for calls_of in fns.values():  # outside capture first: a library's lazy set-up (cuBLAS's handle) cannot be captured
        calls_of[0]()
    torch.cuda.synchronize()
    for name, calls_of in fns.items():
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            for i in range(calls):
                calls_of[i % len(calls_of)]()
        graph.replay()  # the first replay uploads the graph
        graphs[name] = graph
    out: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) / calls)
    return out
