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
