"""Why a GPU-bound 2:4 call can run slower eagerly than replayed in a CUDA graph, where dense does not.

The quick sweeps read the rule's kernel 5-26% slower eagerly (``rule_eager_ms``) than
as a graph (``dense_ms / speedup``) on layers whose kernels take 50-170 us, where
the host is far ahead and host work cannot be the cause; dense read 0.86-1.1x.
For each layer and n, alternating, medians of rounds:

* ``graph``: ``triton.testing.do_bench_cudagraph`` (as the sweep's kernel time);
* ``events``: CUDA events around back-to-back eager calls (device time a call, host ahead);
* ``kernel``: the kernels' own durations under ``torch.profiler`` (CUPTI), eager.

for ``F.linear``, ``kp.sparse24.linear`` and the cuda_ws kernel called directly
(``MmaLinear``, as the sweep's graph path calls it).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_eager_gap.py \
        [--shape MxKxN ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
import triton.testing

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.timing import kernel_device_ms

SHAPES = ("4608x36864x256", "5120x17920x256", "16384x3072x256", "8192x8192x256", "4096x14336x256",
          "4096x4096x4096")


def events_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="*", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    for s in a.shape:
        m, k, n = map(int, s.split("x"))
        w = kp.sparse24.prune(torch.randn(m, k, device=dev)).bfloat16()
        w24 = kp.sparse24.compress(w).packed()
        x = torch.randn(n, k, device=dev).bfloat16()
        direct = MmaLinear(None, WsKernel())
        fns = {"dense": lambda: F.linear(x, w), "linear": lambda: kp.sparse24.linear(x, w24),
               "direct": lambda: direct(x, w24.values, w24.metadata, None)}
        ref = F.linear(x.double(), w.double())
        errs = {name: float((fn().double() - ref).norm() / ref.norm()) for name, fn in fns.items()}
        reads = {name: {"graph": [], "events": []} for name in fns}
        for _ in range(a.rounds):
            for name, fn in fns.items():
                reads[name]["graph"].append(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
                reads[name]["events"].append(events_ms(fn))
        row = {"m": m, "k": k, "n": n, "errors": errs}
        for name, fn in fns.items():
            row[name] = {key: statistics.median(v) for key, v in reads[name].items()}
            row[name]["kernels"] = {kn[:60]: t for kn, t in kernel_device_ms(fn, 20).items()}
        rows.append(row)
        print(f"{m}x{k} n={n}: " + "  ".join(
            f"{name} graph {row[name]['graph'] * 1e3:.1f} events {row[name]['events'] * 1e3:.1f} us"
            for name in fns), flush=True)
        for name in fns:
            print(f"    {name} kernels: " + "; ".join(f"{kn} {t * 1e3:.1f} us" for kn, t in row[name]["kernels"].items()))
    results.write("sparse24-eager-gap", {"rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
