"""The gated epilogue's cost at equal tiles: each gated-capable tile of a problem, run with the gated epilogue and
plain (the same tile, M columns out), beside the plain rule's pick and the gated rule's.

For gate/up problems where ``sparse24_gated_sweep.py`` found the gated GEMM slower than the grouped GEMM plus
``kp.gated_activation``: which part is the kernel variant (gated against plain on one tile) and which the rule's
narrower space (``gated_tile``).  CUDA graph replays (``triton.testing.do_bench_cudagraph``, median), bf16.  Writes
``bench/results/sparse24-gated-tiles-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_gated_tiles.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from kernelplan.bench import results
from kernelplan.timing import graph_us
from kernelplan.kernels import raw_stream
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import gated_tile, rule_order, ws_candidates, ws_config
from kernelplan.sparse24.format import prune_compress

PROBLEMS = [(256, 57344, 8192), (256, 37888, 3584), (256, 35840, 5120), (64, 35840, 5120), (512, 37888, 3584),
            (256, 28672, 3584)]



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=5, help="gated tiles per problem, the rule's least cost first")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms, kernel, rows = sm_count(0), WsKernel(), []
    torch.manual_seed(0)
    with torch.inference_mode():
        for n, m, k in PROBLEMS:
            w24 = prune_compress(torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).packed()
            pairs, codes = _tiled(w24.values, w24.metadata)
            x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            ys = {"gated_silu_first": torch.empty(n, m // 2, device="cuda", dtype=torch.bfloat16),
                  None: torch.empty(n, m, device="cuda", dtype=torch.bfloat16)}

            def run(cfg, epilogue):
                y = ys[epilogue]
                launch, grid = kernel.launch_config(cfg, n, m, "bf16", False, epilogue, 0)
                args = (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), 0, y.data_ptr(), n, m, k, x.stride(0),
                        y.stride(0))
                return lambda: launch(grid, args, raw_stream(0))

            gated = sorted((c for c in ws_candidates(n, m, k) if gated_tile(c)),
                           key=lambda c: rule_order(c, n, m, k, sms))[:a.tiles]
            plain_pick, gated_pick = ws_config(n, m, k, sms), ws_config(n, m, k, sms, gated=True)
            tiles = {}
            for cfg in dict.fromkeys([*gated, gated_pick]):
                tiles[str(cfg)] = {"gated_us": graph_us(run(cfg, "gated_silu_first")), "plain_us": graph_us(run(cfg, None))}
            plain_us = graph_us(run(plain_pick, None))
            row = {"n": n, "m": m, "k": k, "plain_rule": str(plain_pick), "plain_rule_us": plain_us,
                   "gated_rule": str(gated_pick), "gated_rule_us": tiles[str(gated_pick)]["gated_us"], "tiles": tiles,
                   "gated_over_plain_same_tile": statistics.median(t["plain_us"] / t["gated_us"] for t in tiles.values()),
                   "best_gated_us": min(t["gated_us"] for t in tiles.values())}
            rows.append(row)
            print(f"{m}x{k} n={n}: plain rule {plain_pick} {plain_us:.1f} us; gated rule {gated_pick} "
                  f"{row['gated_rule_us']:.1f} us; best gated {row['best_gated_us']:.1f}; plain/gated at equal tiles "
                  f"median {row['gated_over_plain_same_tile']:.2f}", flush=True)
            for c, t in tiles.items():
                print(f"    {c}: gated {t['gated_us']:.1f} plain {t['plain_us']:.1f}", flush=True)
    results.write("sparse24-gated-tiles", {"rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
