"""Does the 2:4 kernel keep its per-cycle advantage at the clocks it runs at?  Time, SM clock and power of dense
``F.linear`` and the rule's ``cuda_ws`` kernel, each replayed back to back for about a second.

``bench/wgmma_rate.py`` counts cycles (``clock64``); a user sees time.  Under a sustained tensor-core load the GPU
lowers its clocks to stay in its power limit, and a kernel doing twice the useful work a cycle may draw more
power and run at lower clocks than dense.  Per problem (sweep shapes, weights rotated past L2 as in the sweep),
alternating dense and sparse twice: a CUDA graph of back-to-back calls is replayed for ``--seconds`` while
``nvidia-smi`` samples the SM clock and power draw every 50 ms (the first quarter of the samples dropped).
Reports ms per call, median MHz and W, and the speedup in time and in cycles (time x clock).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_clocks.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.sweep import _cycling, copies_past_l2
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import ws_config
from kernelplan.sparse24 import compress, prune

SHAPES = [(8192, 28672), (28672, 8192), (57344, 8192), (4096, 4096), (3584, 18944), (6144, 4096)]
BATCH = (256, 1024, 4096)
CALLS = 32  # calls per graph


def sampled(fn, seconds: float) -> dict:
    """Replays ``fn`` (a CUDA graph) for about ``seconds`` while nvidia-smi samples clock and power."""
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()),
                            "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    replays = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            fn()
        replays += 8
        torch.cuda.synchronize()  # keeps the queue short, so the samples cover the replays
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out = smi.communicate()[0]
    samples = [tuple(float(v) for v in line.split(",")) for line in out.strip().splitlines() if "," in line]
    samples = samples[len(samples) // 4:] or samples
    return {"ms": start.elapsed_time(end) / (replays * CALLS), "mhz": statistics.median(s[0] for s in samples),
            "watts": statistics.median(s[1] for s in samples), "samples": len(samples)}


def graph_of(fn):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms, l2 = sm_count(0), torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for m, k in SHAPES:
        w = prune(torch.randn(m, k, device=dev)).bfloat16()
        w24 = compress(w).packed()
        copies = copies_past_l2(l2, w24.values.nbytes + w24.metadata.nbytes, "cold")
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        w24s = [w24] + [compress(c).packed() for c in ws[1:]]
        for n in BATCH:
            x = torch.randn(n, k, device=dev).bfloat16()
            call = MmaLinear(None, WsKernel())
            ref = F.linear(x.double(), w.double())
            err = float((call(x, w24.values, w24.metadata, None).double() - ref).norm() / ref.norm())
            if not err < 1e-2:
                raise SystemExit(f"{m}x{k} n={n}: cuda_ws relative error {err:.3g}")
            kinds = {"dense": graph_of(_cycling([lambda c=c: F.linear(x, c) for c in ws])),
                     "sparse": graph_of(_cycling([lambda c=c: call(x, c.values, c.metadata, None) for c in w24s]))}
            runs = {name: [] for name in kinds}
            for _ in range(2):
                for name, fn in kinds.items():
                    runs[name].append(sampled(fn, a.seconds))
            row = {"m": m, "k": k, "n": n, "ws_config": str(ws_config(n, m, k, sms)), "weight_copies": copies}
            for name, rs in runs.items():
                for key in ("ms", "mhz", "watts"):
                    row[f"{name}_{key}"] = statistics.median(r[key] for r in rs)
            row["speedup"] = row["dense_ms"] / row["sparse_ms"]
            row["cycle_speedup"] = row["speedup"] * row["dense_mhz"] / row["sparse_mhz"]
            rows.append(row)
            print(f"{m:>6}x{k:<6} n={n:<5} dense {row['dense_ms'] * 1e3:8.1f} us {row['dense_mhz']:5.0f} MHz "
                  f"{row['dense_watts']:4.0f} W | sparse {row['sparse_ms'] * 1e3:8.1f} us {row['sparse_mhz']:5.0f} MHz "
                  f"{row['sparse_watts']:4.0f} W | {row['speedup']:.2f}x in time, {row['cycle_speedup']:.2f}x in cycles",
                  flush=True)
        del w, w24, ws, w24s
        torch.cuda.empty_cache()
    results.write("sparse24-clocks", {"rows": rows}, a.out, dtype="bf16", calls_per_graph=CALLS,
                  timing="CUDA graph of back-to-back calls replayed for --seconds, weights rotated past L2; "
                         "nvidia-smi clocks.sm and power.draw every 50 ms, first quarter dropped; medians of 2 "
                         "alternating runs", seconds=a.seconds)


if __name__ == "__main__":
    main()
