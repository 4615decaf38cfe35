"""A MoE layer's experts held 2:4 (``kp.nn.Sparse24Experts``) against the dense transformers module, on the GPU.

The 2:4 module runs each projection as one grouped launch (``kernels/sparse24_grouped.py``); ``sparse24_loop`` is
the same module one GEMM per expert, as it runs with autograd.

The expert sizes of published MoE configs (``MODELS``: experts, hidden, intermediate, top k), in Mixtral's module
(SiLU gating, no bias), bf16, random weights and routing (top-k of random logits).  For each token count:

* as CUDA graphs (``triton.testing.do_bench_cudagraph``): the dense module under transformers' ``grouped_mm`` (its
  default on the GPU, written to be captured) against the 2:4 module;
* as eager calls (``triton.testing.do_bench``): those two, transformers' ``eager`` loop, and the 2:4 module one GEMM
  an expert (``sparse24_loop``; neither loop can be captured: they read the routing on the host);
* both ways, the 2:4 module with its gating as torch ops between the two launches and its pairs reordered and
  weighted by torch ops after them (``sparse24_unfused``), where the module runs the gating in the first launch's
  epilogue and the rest in the second's store;
* the host work of an eager call alone (``host_us``: the clock stops when the last of 20 calls returns), of the
  dense module and the 2:4 one;
* with ``--max-rows R``, both ways, the 2:4 module with its grouped tiles capped at R rows of x
  (``sparse24_rows<R>``): the tile choice against a narrower one, side by side;

medians of alternating rounds; the 2:4 module's relative error against the dense module of the same pruned weights;
bytes held by each.  Writes ``bench/results/sparse24-experts-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_experts.py
"""

from __future__ import annotations

import argparse
import functools
import copy
import sys

import torch

from kernelplan.bench import results
from kernelplan.nn import Sparse24Experts
from kernelplan.timing import host_us_per_call, interleaved

MODELS = {  # (experts, hidden, intermediate, top k): the routed experts of each config.json
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Mixtral-8x22B": (8, 6144, 16384, 2),
    "Phi-3.5-MoE": (16, 4096, 6400, 2),
    "gpt-oss-20b": (32, 2880, 2880, 4),  # its sizes only: gpt-oss's own module adds biases and clamped gating
    "Qwen1.5-MoE-A2.7B": (60, 2048, 1408, 4),
    "DeepSeek-V2-Lite": (64, 2048, 1408, 6),
    "OLMoE-1B-7B": (64, 2048, 1024, 8),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "Qwen3-235B-A22B": (128, 4096, 1536, 8),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}
TOKENS = (1, 4, 16, 64, 128, 512, 2048)


def dense_experts(experts: int, hidden: int, inner: int, implementation: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts)
    cfg._experts_implementation = implementation
    with torch.device("cuda"):
        mod = MixtralExperts(cfg).bfloat16()
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02)
    return mod


def routed(tokens: int, hidden: int, experts: int, k: int):
    """``(x, index, weights)``: ``tokens`` random bf16 rows on the GPU, each routed to its top ``k`` of ``experts`` by
    random logits, the weights in bf16 (as a router gives them)."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, index = torch.randn(tokens, experts, device="cuda").softmax(-1).topk(k, dim=-1)
    return x, index, weights.bfloat16()


def sparse_calls(models, token_counts):
    """For each published config of ``models`` and each token count: ``(model, (experts, hidden, inner, k), tokens,
    call)``, where ``call()`` runs the config's ``Sparse24Experts`` (random weights, magnitude-pruned) on ``routed``
    inputs.  A config's weights are let go before the next one's are made."""
    from kernelplan.nn import Sparse24Experts

    for model in models:
        count, hidden, inner, k = MODELS[model]
        sparse = Sparse24Experts.from_experts(dense_experts(count, hidden, inner, "grouped_mm"))
        for tokens in token_counts:
            yield model, MODELS[model], tokens, functools.partial(sparse, *routed(tokens, hidden, count, k))
        sparse = None
        torch.cuda.empty_cache()


def capped(rows: int, module, *args):
    """``module(*args)`` with the grouped kernel's tiles at most ``rows`` rows of x (a graph captured so keeps them)."""
    from kernelplan.kernels import sparse24_grouped

    widths = sparse24_grouped.GROUPED_ROWS
    sparse24_grouped.GROUPED_ROWS = tuple(r for r in widths if r <= rows)
    try:
        return module(*args)
    finally:
        sparse24_grouped.GROUPED_ROWS = widths


def main() -> int:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--max-rows", type=int, default=None, help="also time the grouped tiles capped at this many rows")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in a.models:
        experts, hidden, inner, k = MODELS[model]
        dense = dense_experts(experts, hidden, inner, "grouped_mm")
        sparse = Sparse24Experts.from_experts(dense)
        with torch.no_grad():  # the dense module computes with the pruned weights: the same function
            for e in range(experts):
                dense.gate_up_proj[e] = sparse.first[e].to_dense()
                dense.down_proj[e] = sparse.down[e].to_dense()
        loop = copy.copy(sparse)  # the same weights, one GEMM per expert (the path with autograd and off Hopper)
        loop._grouped = lambda x: False
        unfused = copy.copy(sparse)  # the gating between the launches and the pairs' combining after, as torch ops
        unfused._epilogue = None
        unfused._modules = dict(sparse._modules)  # its own registry: the norm below is the copy's alone
        unfused.post_expert_norm = torch.nn.Identity()  # a norm after the experts keeps the combining out of the store
        eager = copy.copy(dense)
        eager.config = copy.copy(dense.config)
        eager.config._experts_implementation = "eager"
        dense_bytes = sum(p.nbytes for p in dense.parameters())
        held = sum(m.values.nbytes + m.metadata.nbytes for m in [*sparse.first, *sparse.down])
        for tokens in a.tokens:
            x, index, weights = routed(tokens, hidden, experts, k)
            with torch.no_grad():
                want, out = dense(x, index, weights), sparse(x, index, weights)
                err = float((out.double() - want.double()).abs().max() / want.double().abs().max())
                calls = {"grouped_mm": lambda: dense(x, index, weights), "eager": lambda: eager(x, index, weights),
                         "sparse24": lambda: sparse(x, index, weights),
                         "sparse24_loop": lambda: loop(x, index, weights),
                         "sparse24_unfused": lambda: unfused(x, index, weights)}
                if a.max_rows:
                    calls[f"sparse24_rows{a.max_rows}"] = lambda: capped(a.max_rows, sparse, x, index, weights)
                ms = interleaved({n: (lambda f=f: triton.testing.do_bench(f, warmup=5, rep=40)) for n, f in
                                  calls.items()}, a.rounds)
                replay = lambda f: triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median")  # noqa: E731
                graph = interleaved({n: (lambda f=calls[n]: replay(f)) for n in calls
                                     if n not in ("eager", "sparse24_loop")}, a.rounds)
                host = interleaved({n: (lambda f=calls[n]: host_us_per_call(f, x.device, 20, wait=False)) for n in
                                    ("grouped_mm", "sparse24")}, a.rounds)
                grouped = sparse._grouped(x)  # under no_grad, as the calls ran
            row = {"model": model, "experts": experts, "hidden": hidden, "intermediate": inner, "top_k": k,
                   "tokens": tokens, "ms": ms, "graph_ms": graph, "host_us": host, "epilogue": sparse._epilogue,
                   "graph_speedup_vs_grouped_mm": graph["grouped_mm"] / graph["sparse24"],
                   "speedup_vs_grouped_mm": ms["grouped_mm"] / ms["sparse24"],
                   "speedup_vs_eager": ms["eager"] / ms["sparse24"], "rel_err": err, "grouped": grouped,
                   "dense_bytes": dense_bytes, "held_bytes": held}
            rows.append(row)
            print(f"{model:17s} T={tokens:5d}  graph: grouped_mm {graph['grouped_mm']:7.3f} "
                  f"2:4 {graph['sparse24']:7.3f} ms ({row['graph_speedup_vs_grouped_mm']:.2f}x; unfused "
                  f"{graph['sparse24_unfused']:7.3f})  "
                  f"eager: grouped_mm {ms['grouped_mm']:7.3f} "
                  f"2:4 {ms['sparse24']:7.3f} ms ({row['speedup_vs_grouped_mm']:.2f}x; transformers' loop "
                  f"{ms['eager']:7.3f}, a GEMM an expert {ms['sparse24_loop']:7.3f}, unfused "
                  f"{ms['sparse24_unfused']:7.3f})  host {host['grouped_mm']:.0f} / {host['sparse24']:.0f} us  "
                  f"err {err:.1e}  bytes {held / dense_bytes:.4f}x" +
                  "".join(f"  {n}: graph {graph[n]:7.3f}, eager {ms[n]:7.3f} ms" for n in graph if "_rows" in n),
                  flush=True)
        dense = sparse = eager = loop = unfused = None  # freed before the next model
        torch.cuda.empty_cache()
        results.write("sparse24-experts", {"rows": rows}, a.out, dtype="bf16")  # each model's rows kept as they come
    return 0


if __name__ == "__main__":
    sys.exit(main())
