"""How fast a 2:4 weight is converted on the GPU, against the copy bandwidth measured in the same process.

For each shape (the largest layers of the sweep set and a BERT-sized one), in
bf16: ``layout.pack`` and ``layout.unpack`` (public format <-> the device
layout), ``compress`` of a pruned dense weight, ``prune``, ``prune_compress``
straight into the device layout (``packed=True``, one pass), and the whole
``Sparse24Linear.from_dense``, which runs it.  Each op's bandwidth counts the bytes it must read
and write at least; the copy's is a ``copy_`` of the dense weight (read and
write).  Medians of ``triton.testing.do_bench``.  Writes
``bench/results/sparse24-convert-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_convert.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.sparse24.format import prune_compress
from kernelplan.sparse24.layout import pack, unpack

SHAPES = [(28672, 8192), (8192, 28672), (18944, 3584), (3584, 18944), (8192, 8192), (3072, 768)]


def out_path() -> str | None:
    """The results file (--out), or None for bench/results' own name."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    return ap.parse_args().out


def weights(shapes):
    """``(m, k, dense, pruned)`` of each shape: random bf16 on the GPU, and the same pruned to 2:4."""
    for m, k in shapes:
        dense = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        yield m, k, dense, kp.sparse24.prune(dense)


def main() -> int:
    out = out_path()
    rows = []
    for m, k, dense, pruned in weights(SHAPES):
        w24 = kp.sparse24.compress(pruned)
        tv, tm = pack(w24.values, w24.metadata)
        back = unpack(tv, tm)
        assert torch.equal(back[0], w24.values) and torch.equal(back[1], w24.metadata), "round trip"
        one = prune_compress(dense, packed=True)
        assert torch.equal(one.values, tv) and torch.equal(one.metadata, tm), "one pass against three"
        linear = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=torch.bfloat16)
        mk = m * k  # bytes: values MK (bf16), public metadata MK/4, packed metadata MK/8, dense 2 MK
        ops = {
            "copy": (lambda: torch.empty_like(dense).copy_(dense), 4 * mk),
            "pack": (lambda: pack(w24.values, w24.metadata), 2 * mk + mk // 4 + mk // 8),
            "unpack": (lambda: unpack(tv, tm), 2 * mk + mk // 4 + mk // 8),
            "compress": (lambda: kp.sparse24.compress(pruned), 2 * mk + mk + mk // 4),
            "prune": (lambda: kp.sparse24.prune(dense), 4 * mk),
            "prune_compress_packed": (lambda: prune_compress(dense, packed=True), 2 * mk + mk + mk // 8),
            "from_dense": (lambda: kp.nn.Sparse24Linear.from_dense(linear), 2 * mk + mk + mk // 8),
        }
        ms = {name: triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") for name, (fn, _) in ops.items()}
        copy_bw = ops["copy"][1] / ms["copy"] / 1e6
        row = {"m": m, "k": k, "copy_GBps": copy_bw}
        for name, (_, nbytes) in ops.items():
            if name != "copy":
                bw = nbytes / ms[name] / 1e6
                row[name] = {"ms": ms[name], "GBps": bw, "of_copy": bw / copy_bw}
        rows.append(row)
        print(f"{m}x{k}: copy {copy_bw:.0f} GB/s; " + ", ".join(
            f"{n} {row[n]['ms']:.3f} ms ({row[n]['of_copy']:.2f} of copy)" for n in ops if n != "copy"), flush=True)
        del dense, pruned, w24, tv, tm, back, linear
    results.write("sparse24-convert", {"rows": rows}, out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
