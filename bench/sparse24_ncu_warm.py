"""Dense ``F.linear`` and the rule's ``cuda_ws`` kernel on one problem, for ncu, after ``--warm`` calls of each.

Why: ``bench/sparse24_clocks.py`` found the 2:4 kernel taking 14% more cycles back to back than alone under ncu,
and dense 3% more (docs/design/0013).  Profiling one launch of each after a second of back-to-back calls, with
ncu's clock control off (``--clock-control none``), shows whether the hot GPU runs the same instructions in more
cycles, and which unit is then the busier.  Eager launches, alternating, weights rotated past L2 as in the sweep.

    ncu --clock-control none -k regex:'kp_sparse24|nvjet' --launch-skip 800 --launch-count 2 \\
        python bench/sparse24_ncu_warm.py 8192 28672 4096 --warm 400
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernelplan.bench.sweep import copies_past_l2
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import ws_config
from kernelplan.sparse24 import compress, prune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("m", type=int)
    ap.add_argument("k", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("--warm", type=int, default=400, help="calls of each before the profiled pair")
    a = ap.parse_args()
    dev = torch.device("cuda")
    w = prune(torch.randn(a.m, a.k, device=dev)).bfloat16()
    w24 = compress(w).packed()
    copies = copies_past_l2(torch.cuda.get_device_properties(0).L2_cache_size, w24.values.nbytes, "cold")
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    w24s = [w24] + [compress(c).packed() for c in ws[1:]]
    x = torch.randn(a.n, a.k, device=dev).bfloat16()
    call = MmaLinear(None, WsKernel())
    ref = F.linear(x.double(), w.double())
    err = float((call(x, w24.values, w24.metadata, None).double() - ref).norm() / ref.norm())
    if not err < 1e-2:
        raise SystemExit(f"cuda_ws relative error {err:.3g}")
    torch.cuda.synchronize()
    print(f"{a.m}x{a.k} n={a.n}: {ws_config(a.n, a.m, a.k, sm_count(0))}, {copies} weight copies", flush=True)
    for i in range(a.warm + 1):  # the check's launch above is the first of the kernel's
        F.linear(x, ws[i % copies])
        c = w24s[i % copies]
        call(x, c.values, c.metadata, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
