"""Sweep the Triton 2:4 kernel's tiles on the GPU (the heuristic in ``kernels/sparse24.py::config_for``).

    PYTHONPATH=src python bench/sparse24_tiles.py [--ns 1,2,4] [--shapes 4096x14336,...] [--dtype bf16]
        [--heuristic] [--module NAME] [--block-n 32] [--block-m 64,128] [--block-k 128]
        [--splits 1,2] [--warps 4] [--stages 3,4]

For each (M, K, n) prints dense ``F.linear`` and the best few configs, as
speedup over dense and as effective bandwidth on the compressed bytes.
Each config's output is checked against dense before it is timed.  ``--module``
sweeps a variant of ``kernels/sparse24.py`` (a copy beside it, same interface).
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch
import torch.nn.functional as F
import triton.testing

import kernelplan as kp
import kernelplan.kernels.sparse24 as ks

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672)]
GRID = [(bm, bk, s, w, st) for bm, bk, s, w, st in itertools.product(
    [32, 64, 128], [128, 256], [1, 2, 4, 8], [4, 8], [3, 4])]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ns", default="1,16,64,128")
    p.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES), help="MxK weights, comma-separated")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--warps", default="4,8")
    p.add_argument("--block-n", type=int, default=None, help="sweep this N tile instead of the heuristic's")
    p.add_argument("--block-m", default="32,64,128")
    p.add_argument("--block-k", default="128,256")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--stages", default="3,4")
    p.add_argument("--heuristic", action="store_true", help="time config_for's choice alone")
    p.add_argument("--module", default="sparse24", help="a variant of kernels/sparse24.py to sweep instead")
    a = p.parse_args()
    global ks
    ks = importlib.import_module(f"kernelplan.kernels.{a.module}")
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in a.shapes.split(",")]
    for (m, k), n in itertools.product(shapes, [int(v) for v in a.ns.split(",")]):
        w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).to(dtype)
        w24 = kp.sparse24.compress(w)
        x = torch.randn(n, k, device="cuda", dtype=dtype)
        y = torch.empty(n, m, device="cuda", dtype=dtype)
        ref = F.linear(x.float(), w.float())
        dense = triton.testing.do_bench(lambda: F.linear(x, w), warmup=5, rep=20, return_mode="median")
        heuristic = ks.config_for(n, m, k, sms)
        results = []
        allowed = [[int(v) for v in opt.split(",")] for opt in (a.block_m, a.block_k, a.splits, a.warps, a.stages)]
        grid = [] if a.heuristic else [ks.Config(a.block_n or heuristic.block_n, *c) for c in GRID
                                       if all(v in ok for v, ok in zip(c, allowed))]
        for cfg in grid + [heuristic]:
            if k % cfg.block_k or (k // cfg.block_k) % cfg.splits:
                continue
            try:
                y.fill_(float("nan"))
                ks.launch(x, w24.values, w24.metadata, None, y, None, cfg)
                err = float((y.float() - ref).norm() / ref.norm())
                if not err < 2e-2:
                    print(f"  WRONG {cfg}: rel err {err:.3g}")
                    continue
                ms = triton.testing.do_bench(lambda: ks.launch(x, w24.values, w24.metadata, None, y, None, cfg),
                                             warmup=5, rep=20, return_mode="median")
            except Exception as e:  # out of shared memory or registers, say: skip the config
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            results.append((ms, cfg))
        results.sort(key=lambda r: r[0])
        gbytes = m * k * 9 / 16 * 2 / 1e9
        h = next(ms for ms, cfg in results if cfg is heuristic)
        print(f"{a.module} M={m} K={k} n={n}: dense {dense * 1e3:.1f} us; heuristic {dense / h:.2f}x {heuristic}", flush=True)
        for ms, cfg in results[:a.top]:
            print(f"   {dense / ms:.2f}x  {ms * 1e3:.1f} us  {gbytes / ms:.2f} TB/s  {cfg}", flush=True)


if __name__ == "__main__":
    main()
