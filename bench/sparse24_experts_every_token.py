"""Experts that run every token through every expert (Llama-4's ``Llama4TextExperts``) held 2:4 against the dense
transformers module, on the GPU.

Llama-4's MoE repeats its T tokens once an expert, each copy scaled by the router's score (zero where the expert was
not chosen), and its experts module runs ``torch.bmm`` over all E x T rows.  ``Sparse24Experts`` (``every_token``)
runs each projection as one grouped launch with offsets ``0, T, 2T ...`` (``kernels/sparse24_grouped.py``).

The expert sizes of the published Llama-4 configs (``MODELS``: experts, hidden, intermediate), bf16, random weights
magnitude-pruned, the dense module holding the same pruned weights.  For each token count: CUDA graphs
(``do_bench_cudagraph``) and eager calls (``do_bench``), medians of alternating rounds, and the host work of an eager
call alone; the 2:4 module's relative error against the dense one; bytes held by each.  Writes
``bench/results/sparse24-experts-every-token-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_experts_every_token.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernelplan.bench import results
from kernelplan.nn import Sparse24Experts
from kernelplan.timing import host_us_per_call, interleaved

MODELS = {  # (experts, hidden, intermediate): the routed experts of each config.json's text_config
    "Llama-4-Scout-17B-16E": (16, 5120, 8192),
    "Llama-4-Maverick-17B-128E": (128, 5120, 8192),
}
TOKENS = {"Llama-4-Scout-17B-16E": (1, 4, 16, 64, 256, 1024), "Llama-4-Maverick-17B-128E": (1, 16, 128)}


def dense_experts(experts: int, hidden: int, inner: int):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    cfg = Llama4TextConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: Maverick's experts are 64 GB in float32
    try:
        with torch.device("cuda"):
            mod = Llama4TextExperts(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02)
    return mod


def routed(tokens: int, hidden: int, experts: int) -> torch.Tensor:
    """What Llama4TextMoe gives its experts: ``tokens`` random rows repeated once an expert, each copy times its
    router's sigmoid score, zero but for the token's top 1 (Llama-4's ``num_experts_per_tok``)."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    top, index = logits.topk(1, dim=1)
    scores = torch.full_like(logits, -torch.inf).scatter_(1, index, top).sigmoid().bfloat16()
    return x.repeat(experts, 1) * scores.t().reshape(-1, 1)


def main() -> int:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in a.models:
        experts, hidden, inner = MODELS[model]
        dense = dense_experts(experts, hidden, inner)
        sparse = Sparse24Experts.from_experts(dense)
        with torch.no_grad():  # the dense module computes with the pruned weights: the same function
            for e in range(experts):
                dense.gate_up_proj[e] = sparse.first[e].to_dense().t()
                dense.down_proj[e] = sparse.down[e].to_dense().t()
        dense_bytes = sum(p.nbytes for p in dense.parameters())
        held = sum(t.nbytes for layers in (sparse.first, sparse.down) for t in sparse._span(layers)[:2])
        for tokens in TOKENS[model]:
            x = routed(tokens, hidden, experts)
            with torch.no_grad():
                want, out = dense(x), sparse(x)
                err = float((out.double() - want.double()).norm() / want.double().norm())
                calls = {"dense": lambda: dense(x), "sparse24": lambda: sparse(x)}
                ms = interleaved({n: (lambda f=f: triton.testing.do_bench(f, warmup=5, rep=40)) for n, f in
                                  calls.items()}, a.rounds)
                replay = lambda f: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")  # noqa: E731
                graph = interleaved({n: (lambda f=f: replay(f)) for n, f in calls.items()}, a.rounds)
                host = interleaved({n: (lambda f=f: host_us_per_call(f, x.device, 20, wait=False)) for n, f in
                                    calls.items()}, a.rounds)
                grouped = sparse._grouped(x)
            row = {"model": model, "experts": experts, "hidden": hidden, "intermediate": inner, "tokens": tokens,
                   "rows": experts * tokens, "ms": ms, "graph_ms": graph, "host_us": host,
                   "graph_speedup": graph["dense"] / graph["sparse24"], "speedup": ms["dense"] / ms["sparse24"],
                   "rel_err": err, "grouped": grouped, "epilogue": sparse._epilogue, "dense_bytes": dense_bytes,
                   "held_bytes": held}
            rows.append(row)
            print(f"{model:26s} T={tokens:5d}  graph: dense {graph['dense']:8.3f} 2:4 {graph['sparse24']:8.3f} ms "
                  f"({row['graph_speedup']:.2f}x)  eager: dense {ms['dense']:8.3f} 2:4 {ms['sparse24']:8.3f} ms "
                  f"({row['speedup']:.2f}x)  host {host['dense']:.0f} / {host['sparse24']:.0f} us  err {err:.1e}  "
                  f"bytes {held / dense_bytes:.4f}x  grouped {grouped}", flush=True)
        dense = sparse = None  # freed before the next model
        torch.cuda.empty_cache()
        results.write("sparse24-experts-every-token", {"rows": rows}, a.out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
