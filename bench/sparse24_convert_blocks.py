"""The conversion kernels' block sizes, timed: which ``steps`` and warps ``compress_tiled`` (dense straight into the
device layout) and which block ``compress`` (into the public format) run fastest, against a copy of the dense
weight in the same process (median of ``triton.testing.do_bench``).  Each is timed twice: the whole call (outputs
allocated, the kernel, the host's read of the refusal flags, which waits for the GPU) and the kernel alone
(launched back to back on allocated outputs).  Prints a table; writes
``bench/results/sparse24-convert-blocks-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_convert_blocks.py
"""

from __future__ import annotations

import sys

import torch
import triton

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.kernels import sparse24_convert as convert
from sparse24_convert import out_path, weights  # bench/ is on the path, as the docstring's command runs it

SHAPES = [(28672, 8192), (18944, 3584), (8192, 8192), (3072, 768)]
TILED = [(steps, warps) for steps in (1, 2, 4, 8) for warps in (4, 8)]
PUBLIC = [((bm, bg), warps) for bm, bg in ((16, 64), (32, 64), (16, 128), (64, 32)) for warps in (4, 8)]


def timed(call, kernel, nbytes: int, copy_bw: float) -> dict:
    """The whole call's and the kernel's median times, and each as a share of the copy bandwidth."""
    out = {}
    for name, fn in (("", call), ("kernel_", kernel)):
        ms = triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")
        out[name + "ms"], out[name + "of_copy"] = ms, nbytes / ms / 1e6 / copy_bw
    return out


def main() -> int:
    out = out_path()
    rows = []
    for m, k, dense, pruned in weights(SHAPES):
        want = kp.sparse24.compress(pruned).packed()
        mk = m * k
        copy_ms = triton.testing.do_bench(lambda: torch.empty_like(dense).copy_(dense), warmup=5, rep=50,
                                          return_mode="median")
        copy_bw = 4 * mk / copy_ms / 1e6
        row = {"m": m, "k": k, "copy_GBps": copy_bw, "tiled": {}, "public": {}}
        bits = dense.view(torch.int16)
        tv, tm = torch.empty_like(want.values).view(torch.int16), torch.empty_like(want.metadata)
        values, metadata = torch.empty(m, k // 2, dtype=torch.int16, device="cuda"), torch.empty(
            m, k // 8, dtype=torch.int16, device="cuda")
        bad = torch.empty(m * k // 64, dtype=torch.int32, device="cuda")
        for steps, warps in TILED:
            got = convert.compress_tiled(dense, prune=True, steps=steps, warps=warps)
            ok = torch.equal(got[0], want.values) and torch.equal(got[1], want.metadata)
            grid = (m // 16, triton.cdiv(k // 64, steps))
            kernel = lambda: convert._compress24_tiled[grid](bits, tv, tm.view(torch.int8), bad, k, k,  # noqa: E731
                                                             PRUNE=True, ABS=0x7FFF, INF=0x7F80, WIDE=False,
                                                             STEPS=steps, num_warps=warps)
            row["tiled"][f"steps={steps} warps={warps}"] = timed(lambda: convert.compress_tiled(dense, True, steps, warps),
                                                                 kernel, 3 * mk + mk // 8, copy_bw) | {"ok": ok}
        for (bm, bg), warps in PUBLIC:
            grid = (triton.cdiv(m, bm), triton.cdiv(k // 4, bg))
            kernel = lambda: convert._compress24[grid](pruned.view(torch.int16), values, metadata, values, bad, m, k,  # noqa: E731
                                                       k, PRUNE=False, DENSE=False, ABS=0x7FFF, INF=0x7F80,
                                                       WIDE=False, BM=bm, BG=bg, num_warps=warps)
            row["public"][f"block={(bm, bg)} warps={warps}"] = timed(
                lambda: convert.compress(pruned, False, block=(bm, bg), warps=warps), kernel, 3 * mk + mk // 4, copy_bw)
        rows.append(row)
        for part in ("tiled", "public"):
            best = max(row[part], key=lambda c: row[part][c]["of_copy"])
            print(f"{m}x{k} {part}, of copy, call / kernel: " + ", ".join(
                f"{c} {v['of_copy']:.2f} / {v['kernel_of_copy']:.2f}" + ("" if v.get("ok", True) else " WRONG")
                                                  for c, v in row[part].items()) + f"; best {best}", flush=True)
    results.write("sparse24-convert-blocks", {"rows": rows}, out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
