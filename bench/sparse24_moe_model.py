"""Whole MoE models, dense against ``kp.sparsify``'d (experts held 2:4 and run on the grouped kernel), in one process.

Published configs' sizes (``MODELS``), a few decoder layers each, random bf16 weights, no download: Mixtral-8x7B
(8 experts of 14336, top 2), Qwen3-30B-A3B (128 experts of 768, top 8, Qwen3-MoE's own module) and Llama-4-Scout
(16 experts of 8192 and a shared one, top 1, every token through every expert).  The dense model's experts run
transformers' ``grouped_mm``, its default on the GPU (Llama-4's, ``torch.bmm``).  The sparsified model's logits are
checked against the dense model holding the same pruned weights first, on the sequences whose every token both route
alike in every layer (in bf16 a router's near-tie can go either way; a token routed elsewhere is another function, not
an error, and the tokens after it in its sequence attend to it).  Then, alternating dense and sparse (medians of
rounds): one decode step at batch 1, 32 and 128 and a 512-token prefill (Llama-4's without a cache), each replayed as
a CUDA graph and run eagerly (Hugging Face's Python included).  Bytes of each model's weights (the 2:4 layouts its
calls built included) and the GPU memory each one holds are reported.  Writes ``bench/results/sparse24-moe-model-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_moe_model.py
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import DecodeStep, Graphed, GraphedDecode, weight_bytes
from kernelplan.nn import Sparse24Experts, Sparse24Linear
from kernelplan.nn.moe_routes import RoutedMoe
from kernelplan.nn.routes import route_of
from kernelplan.timing import interleaved, wall_seconds

# Each config.json's sizes; `layers` of them (the weights of two models and a masked twin fit one 80 GB GPU).
MODELS = {
    "Mixtral-8x7B": ("MixtralConfig", "MixtralForCausalLM", 2, dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 4, dict(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936)),
    "Llama-4-Scout-17B-16E": ("Llama4TextConfig", "Llama4ForCausalLM", 4, dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
        attention_chunk_size=8192, rope_theta=500000.0, vocab_size=202048)),
}
PREFILL_WITHOUT_CACHE = {"Llama-4-Scout-17B-16E"}


def build(model: str):
    config_cls, model_cls, layers, sizes = MODELS[model]
    cfg = getattr(transformers, config_cls)(num_hidden_layers=layers, max_position_embeddings=4096, **sizes)
    if model_cls != "Llama4ForCausalLM":  # Llama-4's experts have one implementation (torch.bmm): it refuses to set one
        cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        dense = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in dense.parameters():
            if p.dim() == 3:  # experts' weights: transformers' init leaves them as torch.empty made them
                p.normal_(0, cfg.initializer_range)
    return cfg, dense


def masked_twin(dense, sparse):
    """``dense`` holding every 2:4 layer's pruned weight: the function the sparse model computes."""
    twin = copy.deepcopy(dense)
    with torch.no_grad():
        for name, mod in sparse.named_modules():
            if isinstance(mod, Sparse24Experts):
                for part, t in mod.dense_parts().items():
                    getattr(twin.get_submodule(name), part).copy_(t)
            elif isinstance(mod, Sparse24Linear) and ".first." not in name and ".down." not in name:
                twin.get_submodule(name).weight.copy_(mod.to_dense())
    return twin


def routed_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits on ``ids`` and, per token, its experts in every layer ``[tokens, layers x top k]`` (each
    router's top-k indices, sorted)."""
    routes, hooks = [], []
    for mod in model.modules():
        if type(mod).__name__.endswith("TopKRouter"):  # (logits, top-k weights, top-k experts)
            hooks.append(mod.register_forward_hook(lambda m, args, out: routes.append(out[2].sort(-1).values)))
        elif type(mod).__name__ == "Llama4Router":  # (scores [T, E], zero for the experts not chosen; logits)
            hooks.append(mod.register_forward_hook(lambda m, args, out: routes.append(out[0].gt(0).long())))
    try:
        logits = model(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits.flatten(0, -2), torch.cat(routes, dim=-1)


def agreement(sparse, masked, ids: torch.Tensor) -> dict:
    """The sparse model's logits against its masked-dense twin's on the sequences of ``ids [B, T]`` whose every token
    both route alike in every layer."""
    (got, a), (want, b) = routed_logits(sparse, ids), routed_logits(masked, ids)
    tokens = (a == b).all(-1)
    same = tokens.view(ids.shape).all(-1).repeat_interleave(ids.shape[1])
    return {"tokens_routed_alike": float(tokens.float().mean()),
            "sequences_routed_alike": int(same.sum()) // ids.shape[1], "sequences": ids.shape[0],
            "logits_rel_err_routed_alike": float((got - want)[same].abs().max() / want[same].abs().max()),
            "logits_rel_err_all_tokens": float((got - want).abs().max() / want.abs().max())}


def replay_error(graphed: Graphed) -> dict:
    """A replay against an eager call: the largest error, and the median token's (bf16 routing near-ties again)."""
    eager = graphed.fn().float().flatten(0, -2)
    graphed.graph.replay()
    diff = (graphed.out.float().flatten(0, -2) - eager).abs()
    return {"max": float(diff.max() / eager.abs().max()),
            "median_token": float((diff.amax(-1) / eager.abs().amax(-1)).median())}


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def one_model(model: str, rounds: int) -> dict:
    torch.manual_seed(0)
    cfg, dense = build(model)
    sparse = copy.deepcopy(dense)
    report = kp.sparsify(sparse, progress=False, experts="all")
    models = {"dense": dense, "sparse": sparse}
    if any(isinstance(route_of(m), RoutedMoe) for m in sparse.modules()):
        # Llama-4's MoE layers routed to their chosen experts (nn/moe_routes.py), and a copy that runs every expert
        # on every token as transformers' module does: the routing's gain apart from 2:4's.
        unrouted = copy.deepcopy(sparse)
        for m in unrouted.modules():
            if isinstance(route_of(m), RoutedMoe):
                route_of(m).detach()
        models["sparse_unrouted"] = unrouted
        del unrouted
    out: dict = {"model": model, "layers": cfg.num_hidden_layers, "converted": len(report.converted),
                 "skipped": dict(report.skipped), "rows": []}
    with torch.inference_mode():
        sparse(torch.randint(0, cfg.vocab_size, (1, 4), device="cuda"))  # a route's first call runs the module twice
        masked = masked_twin(dense, sparse)
        out |= (check := agreement(sparse, masked, torch.randint(0, cfg.vocab_size, (32, 16), device="cuda")))
        del masked
        print(f"{model}: {report.summary().splitlines()[0]}; against the masked-dense model: "
              f"{check['tokens_routed_alike']:.1%} of tokens and {check['sequences_routed_alike']} of 32 sequences "
              f"routed alike, on those logits rel err "
              f"{check['logits_rel_err_routed_alike']:.1e} (all tokens {check['logits_rel_err_all_tokens']:.1e})",
              flush=True)
        for batch in (1, 32, 128):
            prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device="cuda")
            steps = {n: DecodeStep(m, prompt, 16 + 16 + 8 * (rounds + 2) * 2) for n, m in models.items()}
            graphs = {n: GraphedDecode(s) for n, s in steps.items()}
            check = max(g.check() for g in graphs.values())
            graph = interleaved({n: lambda g=g: g.replay_seconds(4) for n, g in graphs.items()}, rounds, 1)
            eager = interleaved({n: lambda s=s: wall_seconds(s) for n, s in steps.items()}, rounds, 3)
            out["rows"].append(_row(f"decode batch {batch}", graph, eager, check))
            del graphs, steps
        for tokens in (512,):
            ids = torch.randint(0, cfg.vocab_size, (1, tokens), device="cuda")
            # Llama-4's cache makes its sliding-window tensors on the host at each forward's first update, which a
            # CUDA graph's capture refuses: its prefill is timed without one.
            cached = model not in PREFILL_WITHOUT_CACHE
            graphs = {n: Graphed(lambda m=m: m(ids, use_cache=cached).logits) for n, m in models.items()}
            check = {n: replay_error(g) for n, g in graphs.items()}
            graph = interleaved({n: lambda g=g: g.replay_seconds(3) for n, g in graphs.items()}, rounds, 1)
            eager = interleaved({n: lambda m=m: wall_seconds(lambda: m(ids, use_cache=cached)) for n, m in
                                 models.items()}, rounds, 3)
            out["rows"].append(_row(f"prefill {tokens}{'' if cached else ' (no cache)'}", graph, eager, check))
            del graphs
    out["weight_bytes"] = {n: weight_bytes(m) for n, m in models.items()}
    out["sparse_over_dense_bytes"] = out["weight_bytes"]["sparse"] / out["weight_bytes"]["dense"]
    experts = [m for m in sparse.modules() if isinstance(m, Sparse24Experts)]
    out["experts_bytes"] = {"dense": sum(p.nbytes for mod in dense.modules()  # experts' weights: 3-D
                                         for p in mod.parameters(recurse=False) if p.dim() == 3),
                            "sparse": sum(weight_bytes(m) for m in experts)}
    models.pop("sparse_unrouted", None)
    del experts, models, report
    with_both = allocated()
    del sparse
    with_dense = allocated()
    del dense
    out["gpu_memory_bytes"] = {"dense": with_dense - allocated(), "sparse": with_both - with_dense}
    torch.cuda.empty_cache()
    print(f"{model}: weights dense {out['weight_bytes']['dense'] / 2**30:.2f} GiB, sparse "
          f"{out['weight_bytes']['sparse'] / 2**30:.2f} GiB ({out['sparse_over_dense_bytes']:.3f}x); experts "
          f"{out['experts_bytes']['sparse'] / out['experts_bytes']['dense']:.4f}x; GPU memory held dense "
          f"{out['gpu_memory_bytes']['dense'] / 2**30:.2f} GiB, sparse {out['gpu_memory_bytes']['sparse'] / 2**30:.2f} "
          f"GiB", flush=True)
    return out


def _row(case: str, graph: dict, eager: dict, check) -> dict:
    row = {"case": case, "replay_vs_eager_rel_err": check}
    for mode, t in (("graph", graph), ("eager", eager)):
        row |= {f"{mode}_{name}_ms": s * 1e3 for name, s in t.items()}
        row[f"{mode}_speedup"] = t["dense"] / t["sparse"]
        if "sparse_unrouted" in t:
            row[f"{mode}_speedup_unrouted"] = t["dense"] / t["sparse_unrouted"]
    unrouted = "".join(f"; every expert on every token {row[f'{mode}_sparse_unrouted_ms']:7.3f} ms "
                       f"({row[f'{mode}_speedup_unrouted']:.2f}x)" for mode in ("graph", "eager")
                       if f"{mode}_speedup_unrouted" in row)
    print(f"  {case:15s} graph {row['graph_dense_ms']:7.3f} / {row['graph_sparse_ms']:7.3f} ms "
          f"({row['graph_speedup']:.2f}x)   eager {row['eager_dense_ms']:7.3f} / {row['eager_sparse_ms']:7.3f} ms "
          f"({row['eager_speedup']:.2f}x){unrouted}   replay err {check}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    done = []
    for model in a.models:
        done.append(one_model(model, a.rounds))
        results.write("sparse24-moe-model", {"models": done}, a.out, transformers=transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
