"""Each layer of the sweep set at small n, back to back (as the sweep times it) and after a torch elementwise kernel
that writes its x (as a norm or an activation does in a model), dense ``F.linear`` against ``kp.sparse24.linear``.

Why: at n <= 16 a 2:4 call's time fits ``F + held bytes / BW`` with F about 4.9 us on the H100 (the sweep at ebb068f),
and the feed probe finds its copies bound it (docs/design/0048).  Back to back, a kernel's launch can overlap the one
before it; in a model the kernel before a projection is usually not a GEMM.  This bench says whether the sweep's
back-to-back reading moves the speedup at these sizes.  CUDA graphs of ``tiles.calls_per_replay`` calls each,
weights rotated past the L2, all variants in alternating rounds (``timing.graph_rounds``); the chained layer's time
is the chain's minus the elementwise kernels' alone, round by round.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_chain.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.bench.sweep import copies_past_l2
from kernelplan.sparse24 import compress, linear, prune
from kernelplan.sparse24.tiles import calls_per_replay
from kernelplan.timing import graph_rounds


def problem_calls(n: int, m: int, k: int, dtype) -> dict:
    """``{variant: [call per weight copy]}``: the elementwise kernel alone, and dense and 2:4 each back to back and
    after it.  Raises where the 2:4 result is off fp64's by more than twice dense's error plus 1e-3 (the sweep's
    check)."""
    props = torch.cuda.get_device_properties(0)
    w = prune(torch.randn(m, k, device="cuda")).to(dtype)
    w24 = compress(w).packed()
    copies = copies_past_l2(props.L2_cache_size, w24.values.nbytes + w24.metadata.nbytes, "cold")
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    w24s = [w24] + [compress(c).packed() for c in ws[1:]]
    h, g = torch.randn(n, k, device="cuda").to(dtype), torch.randn(n, k, device="cuda").to(dtype)
    x = torch.empty(n, k, device="cuda", dtype=dtype)
    torch.mul(h, g, out=x)
    ref = F.linear(x.double(), w.double())
    errs = [float((y.double() - ref).norm() / ref.norm()) for y in (F.linear(x, w), linear(x, w24))]
    if not errs[1] <= 2 * errs[0] + 1e-3:
        raise SystemExit(f"{m}x{k} n={n}: 2:4 relative error {errs[1]:.3g} against dense's {errs[0]:.3g}")

    def prep():
        torch.mul(h, g, out=x)

    def chained(layer):
        prep()
        layer()

    dense = [lambda c=c: F.linear(x, c) for c in ws]
    sparse = [lambda c=c: linear(x, c) for c in w24s]
    for call in sparse:  # each copy's first call builds what its kernel reads, which a capture cannot
        call()
    return {"elementwise": [prep], "dense": dense, "kp": sparse,
            "dense_chained": [lambda f=f: chained(f) for f in dense],
            "kp_chained": [lambda f=f: chained(f) for f in sparse]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--min-mb", type=float, default=0.0, help="only layers of at least this many dense MB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", choices=("bf16", "f16"), default="bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else list(sweep_shapes())
    shapes = [(m, k) for m, k in shapes if 2 * m * k >= a.min_mb * 1e6]
    rows = []
    print(f"{'M':>6} {'K':>6} {'n':>3} {'MB':>5} {'dense':>7} {'kp':>7} {'x':>5}  {'dense':>7} {'kp':>7} {'x':>5}"
          "  (us a layer: back to back | after a torch elementwise kernel)", flush=True)
    for m, k in shapes:
        for n in a.batch:
            fns = problem_calls(n, m, k, dtype)
            per_round = graph_rounds(fns, calls_per_replay(n, m, k), a.rounds)
            ms = {name: statistics.median(t) for name, t in per_round.items()}
            # The chained layer: each round's chain less that round's elementwise kernels alone.
            for side in ("dense", "kp"):
                ms[f"{side}_after"] = statistics.median(
                    c - e for c, e in zip(per_round[f"{side}_chained"], per_round["elementwise"]))
            row = {"m": m, "k": k, "n": n, "ms": ms, "speedup": ms["dense"] / ms["kp"],
                   "speedup_after": ms["dense_after"] / ms["kp_after"]}
            rows.append(row)
            us = {name: v * 1e3 for name, v in ms.items()}
            print(f"{m:6d} {k:6d} {n:3d} {2 * m * k / 1e6:5.0f} {us['dense']:7.1f} {us['kp']:7.1f} "
                  f"{row['speedup']:5.2f}  {us['dense_after']:7.1f} {us['kp_after']:7.1f} {row['speedup_after']:5.2f}"
                  f"  (elementwise {us['elementwise']:.1f})", flush=True)
        torch.cuda.empty_cache()
        results.write("sparse24-chain", {"rows": rows}, a.out, dtype=a.dtype, batch=a.batch, rounds=a.rounds)
    if rows:
        for key in ("speedup", "speedup_after"):
            print(f"{key}: median {statistics.median(r[key] for r in rows):.3f}, "
                  f"min {min(r[key] for r in rows):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
