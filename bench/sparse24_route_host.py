"""Host time of one routed MLP call, with the route's children check (``EpilogueRoute.children_replaced``) and without.

A route compares the module's children, by identity, on every call (docs/design/0043): while one was replaced
(a PEFT adapter), the module runs its own forward.  This measures what that check costs a call on the host, against
the call's whole host time and dense ``F.linear``'s, for a Llama MLP (gate/up on one GEMM with SwiGLU in its
epilogue; Qwen2.5-7B's sizes) and a GPT-2 MLP (c_fc with GELU in its epilogue), bf16, n = 1 and 32, under
``torch.inference_mode``: microseconds of host work per call (the clock stops when the last call returns, before
the device drains), alternating rounds, medians.  "no check" replaces the instance's ``children_replaced`` with a
function returning False.  Writes ``bench/results/sparse24-route-host-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_route_host.py
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.timing import host_us_per_call, interleaved


def _mlps():
    import transformers

    llama = transformers.LlamaConfig(hidden_size=3584, intermediate_size=18944, hidden_act="silu")
    gpt2 = transformers.GPT2Config(n_embd=768, n_inner=3072)
    yield "llama 3584x18944", 3584, transformers.models.llama.modeling_llama.LlamaMLP(llama)
    yield "gpt2 768x3072", 768, transformers.models.gpt2.modeling_gpt2.GPT2MLP(3072, gpt2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    cuda, rows = torch.device("cuda"), []
    for name, hidden, dense in _mlps():
        dense = dense.to(cuda, torch.bfloat16).eval()
        routed = copy.deepcopy(dense)
        kp.sparsify(routed, progress=False)
        unchecked = copy.deepcopy(routed)
        with torch.inference_mode():
            for n in (1, 32):
                x = torch.randn(n, hidden, device=cuda, dtype=torch.bfloat16)
                for m in (dense, routed, unchecked):
                    for _ in range(3):
                        m(x)
                route, bare = kp.nn.routes.route_of(routed), kp.nn.routes.route_of(unchecked)
                if route is None or not route.checked or bare is None or not bare.checked:
                    raise SystemExit(f"{name}: the MLP was not routed, or its route not checked: nothing to measure")
                bare.children_replaced = lambda: False
                fused = route.stats["fused"]
                models = {"route": routed, "no check": unchecked, "dense": dense}
                host = interleaved({k: lambda m=m: host_us_per_call(lambda: m(x), cuda, a.calls, wait=False)
                                    for k, m in models.items()}, a.rounds)
                if route.stats["fused"] == fused:
                    raise SystemExit(f"{name}: the timed calls did not run the route")
                rows.append({"mlp": name, "n": n, "host_us": host,
                             "check_us": host["route"] - host["no check"],
                             "route_over_dense": host["route"] / host["dense"]})
                print(rows[-1], flush=True)
    results.write("sparse24-route-host", {"rows": rows, "calls": a.calls, "rounds": a.rounds}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
