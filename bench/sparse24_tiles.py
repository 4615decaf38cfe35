"""Sweep the Triton 2:4 kernel's tiles on the GPU (the heuristic in ``kernels/sparse24.py::config_for``).

    PYTHONPATH=src python bench/sparse24_tiles.py

For each (M, K, n) prints dense ``F.linear`` and the best few configs, as
speedup over dense and as effective bandwidth on the compressed bytes.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F
import triton.testing

import kernelplan as kp
import kernelplan.kernels.sparse24 as ks

SHAPES = [(4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672)]
NS = [1, 16, 64, 128]
GRID = [ks.Config(bn, bm, bk, s, w, st) for bn, bm, bk, s, w, st in itertools.product(
    [16], [32, 64, 128], [128, 256], [1, 2, 4, 8], [4, 8], [3, 4])]


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (m, k), n in itertools.product(SHAPES, NS):
        w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).bfloat16()
        w24 = kp.sparse24.compress(w)
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
        dense = triton.testing.do_bench(lambda: F.linear(x, w), return_mode="median")
        heuristic = ks.config_for(n, m, k, sms)
        results = []
        block_n = heuristic.block_n
        for cfg in [dataclasses.replace(c, block_n=block_n) for c in GRID] + [heuristic]:
            if (k // cfg.block_k) % cfg.splits:
                continue
            try:
                ms = triton.testing.do_bench(
                    lambda: ks.launch(x, w24.values, w24.metadata, None, y, None, cfg), return_mode="median")
            except Exception as e:  # out of shared memory, say: skip the config
                print(f"  {cfg}: {type(e).__name__}")
                continue
            results.append((ms, cfg))
        results.sort(key=lambda r: r[0])
        gbytes = m * k * 9 / 16 * 2 / 1e9
        h = next(ms for ms, cfg in results if cfg is heuristic)
        print(f"M={m} K={k} n={n}: dense {dense * 1e3:.1f} us; heuristic {heuristic} {dense / h:.2f}x")
        for ms, cfg in results[:3]:
            print(f"   {dense / ms:.2f}x  {gbytes / ms:.2f} TB/s  {cfg}")


if __name__ == "__main__":
    main()
