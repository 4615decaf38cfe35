"""Host time of one attention's q/k/v projections, grouped (``kp.nn.fuse_siblings``) against one GEMM each.

Qwen2.5-7B's sizes (q 3584x3584, k and v 512x3584, with bias), bf16, n = 1, under
``torch.inference_mode``: microseconds of host work per pass of the three calls (the clock
stops when the last call returns, before the device drains), alternating rounds, medians; and
device time of the same passes replayed as a CUDA graph.  Writes
``bench/results/sparse24-siblings-host-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_siblings_host.py
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import Graphed
from kernelplan.nn import fuse_siblings
from kernelplan.timing import host_us_per_call, interleaved


class QKV(nn.Module):
    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, m) for m in (hidden, kv, kv))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows, cuda = [], torch.device("cuda")
    for hidden, kv in ((3584, 512), (4096, 1024), (1024, 1024)):
        alone = QKV(hidden, kv).to("cuda", torch.bfloat16)
        kp.sparsify(alone, progress=False, fuse=False)
        grouped = copy.deepcopy(alone)
        (siblings,) = fuse_siblings(grouped)
        models = {"one GEMM each": alone, "grouped": grouped}
        with torch.inference_mode():
            for n in (1, 32):
                x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
                for m in models.values():
                    for _ in range(3):
                        m(x)
                got, want = grouped(x), alone(x)
                err = max(float((g.float() - w.float()).abs().max() / w.float().abs().max()) for g, w in zip(got, want))
                host = interleaved({k: lambda m=m: host_us_per_call(lambda: m(x), cuda, a.calls, wait=False)
                                    for k, m in models.items()}, a.rounds)
                graphs = {k: Graphed(lambda m=m: torch.cat(m(x), -1)) for k, m in models.items()}
                device = interleaved({k: lambda g=g: g.replay_seconds(50) * 1e6 for k, g in graphs.items()}, a.rounds)
                rows.append({"hidden": hidden, "kv": kv, "n": n, "rel_err": err, "host_us": host, "graph_us": device,
                             "host_ratio": host["grouped"] / host["one GEMM each"],
                             "graph_ratio": device["grouped"] / device["one GEMM each"]})
                print(rows[-1], flush=True)
        print(siblings)
    results.write("sparse24-siblings-host", {"rows": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
