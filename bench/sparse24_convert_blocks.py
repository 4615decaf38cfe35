"""The conversion kernels' block sizes, timed: which ``steps`` and warps ``compress_tiled`` (dense straight into the
device layout) and which block ``compress`` (into the public format) run fastest, against a copy of the dense
weight in the same process (median of ``triton.testing.do_bench``).  Prints a table; writes
``bench/results/sparse24-convert-blocks-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_convert_blocks.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.kernels import sparse24_convert as convert

SHAPES = [(28672, 8192), (18944, 3584), (8192, 8192), (3072, 768)]
TILED = [(steps, warps) for steps in (1, 2, 4, 8) for warps in (4, 8)]
PUBLIC = [((bm, bg), warps) for bm, bg in ((16, 64), (32, 64), (16, 128), (64, 32)) for warps in (4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for m, k in SHAPES:
        dense = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        pruned = kp.sparse24.prune(dense)
        want = kp.sparse24.compress(pruned).packed()
        mk = m * k
        copy_ms = triton.testing.do_bench(lambda: torch.empty_like(dense).copy_(dense), warmup=5, rep=50,
                                          return_mode="median")
        copy_bw = 4 * mk / copy_ms / 1e6
        row = {"m": m, "k": k, "copy_GBps": copy_bw, "tiled": {}, "public": {}}
        for steps, warps in TILED:
            tv, tm = convert.compress_tiled(dense, prune=True, steps=steps, warps=warps)
            ok = torch.equal(tv, want.values) and torch.equal(tm, want.metadata)
            ms = triton.testing.do_bench(lambda: convert.compress_tiled(dense, True, steps, warps), warmup=5, rep=50,
                                         return_mode="median")
            row["tiled"][f"steps={steps} warps={warps}"] = {"ms": ms, "of_copy": (3 * mk + mk // 8) / ms / 1e6 / copy_bw,
                                                            "ok": ok}
        for block, warps in PUBLIC:
            ms = triton.testing.do_bench(lambda: convert.compress(pruned, False, block=block, warps=warps), warmup=5,
                                         rep=50, return_mode="median")
            row["public"][f"block={block} warps={warps}"] = {"ms": ms, "of_copy": (3 * mk + mk // 4) / ms / 1e6 / copy_bw}
        rows.append(row)
        for part in ("tiled", "public"):
            best = max(row[part], key=lambda c: row[part][c]["of_copy"])
            print(f"{m}x{k} {part}: " + ", ".join(f"{c} {v['of_copy']:.2f}" + ("" if v.get("ok", True) else " WRONG")
                                                  for c, v in row[part].items()) + f"; best {best}", flush=True)
    results.write("sparse24-convert-blocks", {"rows": rows}, a.out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
