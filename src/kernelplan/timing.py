"""Host time per call: what a small problem costs on the CPU side of a launch (tuning and the benchmarks)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def host_us_per_call(fn: Callable, dev: torch.device, calls: int) -> float:
    """Wall time per call of ``calls`` back-to-back calls, after a warm-up.

    On a GPU whose kernels are shorter than the host work this is the host
    work: the launch queue never fills, so nothing waits on the device.
    """
    for _ in range(max(calls // 10, 1)):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_us_side_by_side(fns: dict[str, Callable], dev: torch.device, calls: int, rounds: int = 7) -> dict[str, float]:
    """``host_us_per_call`` of each of ``fns``, in interleaved rounds; the median round of each.

    Host time on a shared machine drifts and jumps (one H100 host gave F.linear 22 and then
    24 µs, and torch.empty 5.6 and then 15 µs, in back-to-back rounds): rounds that alternate
    between the calls compared expose each to the same drift, and the median drops the jumps.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(host_us_per_call(fn, dev, calls))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
