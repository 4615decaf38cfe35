"""A decoder model, 4 layers, dense against ``kp.sparsify``'d, in one process (bf16).

By default a Llama built with Qwen2.5-7B's sizes (hidden 3584, intermediate
18944, 28 heads, 4 KV heads, vocabulary 152064: issue 26's measurement).
``--model`` picks another of ``ARCHITECTURES``: a model family's own
transformers class at the sizes of its published config (``bench/shapes.py``),
held out of everything the kernels' rules were fitted on.  Random weights, no
download.  The sparsified model's logits
are checked against the masked-dense model first.  Then, alternating dense and
sparse (medians of rounds): one decode step at batch 1, 32 and 128 and a
512-token prefill, each replayed as a CUDA graph and run eagerly (Hugging Face's
Python included).  GPU memory of each model's weights is reported, the 2:4
layouts built by the calls included.  With ``--profile``, one eager step of each case and model is also
profiled (CUPTI kernel durations), its device time split into the 2:4 kernels, the other GEMMs, attention
and the rest: what bounds the model's speedup where the linear layers are not all of its time.  Writes
``bench/results/sparse24-model-<gpu>.json`` (``sparse24-model-<model>-<gpu>.json`` for another ``--model``).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_model.py [--model NAME]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import DecodeStep, Graphed, GraphedDecode, weight_bytes
from kernelplan.bench.shapes import MODELS
from kernelplan.nn import Sparse24Linear, fuse_siblings
from kernelplan.activations import GATED_EPILOGUES
from kernelplan.nn.gated_siblings import gated_mlp_of
from kernelplan.nn.siblings import SPECS, Spec, member_forward, siblings_of
from kernelplan.timing import by_short_name, interleaved, kernel_device_ms, wall_seconds


# Kernel names by class, first match wins: the 2:4 kernels (kp_sparse24_*, cuSPARSELt's), cuBLAS's GEMMs, attention.
_CLASSES = (("2:4", ("kp_sparse24", "sm90_xmma_sparse", "sparse")), ("gemm", ("nvjet", "gemm", "cutlass", "xmma")),
            ("attention", ("flash", "fmha", "attention", "sdpa")))


def kernel_split(fn, calls: int = 3) -> dict[str, float]:
    """Device ms a call of ``fn`` spends in each kernel class (``_CLASSES``, else "other"), from CUPTI, and the six
    longest kernels of "other" by name."""
    split, other = {name: 0.0 for name, _ in _CLASSES} | {"other": 0.0}, {}
    for name, ms in kernel_device_ms(fn, calls).items():
        key = name.lower()
        cls = next((c for c, marks in _CLASSES if any(mk in key for mk in marks)), "other")
        split[cls] += ms
        if cls == "other":
            other[name] = ms
    split["top other"] = dict(sorted(by_short_name(other, 80).items(), key=lambda kv: -kv[1])[:6])
    return split


class SiblingLinear(torch.nn.Linear):
    """A dense nn.Linear that joins ``fuse_siblings``' groups: the dense model grouped as kp.sparsify groups its own."""

    @classmethod
    def adopt(cls, model, name: str, mod: torch.nn.Linear) -> None:
        mod.__class__ = cls  # the same parameters; only forward changes

    forward = member_forward
    forward_alone = torch.nn.Linear.forward


def _dense_gated(first, x, weight, bias, epilogue: str) -> torch.Tensor:
    """Dense's gated MLP grouped alike: one F.linear on gate and up, then kernelplan's gated kernel (cuBLAS has no
    gated epilogue)."""
    gated = GATED_EPILOGUES[epilogue]
    kind, approximate = {"silu": ("swiglu", "none"), "gelu_tanh": ("geglu", "tanh"), "gelu": ("geglu", "none")}[gated.act]
    return kp.gated_activation(torch.nn.functional.linear(x, weight, bias), kind, gate=gated.gate,
                               approximate=approximate)


SPECS[SiblingLinear] = Spec(("weight",), lambda m: (m.in_features, m.weight.dtype, m.weight.device, m.bias is None),
                            lambda first, x, weight, bias: torch.nn.functional.linear(x, weight, bias),
                            gated=_dense_gated)


def _sibling_calls(model) -> dict[str, int]:
    """Calls of the model's sibling groups by kind (``Siblings.stats``), summed; groups each as they settled."""
    seen, total, groups = set(), {}, {}
    for mod in model.modules():
        siblings = siblings_of(mod)
        if siblings is not None and id(siblings) not in seen:
            seen.add(id(siblings))
            for k, v in siblings.stats.items():
                total[k] = total.get(k, 0) + v
            for g in siblings.groups or ():
                key = "+".join(siblings.names[i] for i in g.index)
                groups[key] = groups.get(key, 0) + 1
    mlps = {}
    for mod in model.modules():
        route = gated_mlp_of(mod)
        if route is not None:
            for k, v in route.stats.items():
                mlps[k] = mlps.get(k, 0) + v
            mlps["off"] = mlps.get("off", 0) + (route.off is not None)
    return {**total, "groups": groups, "gated_mlps": mlps}


DEFAULT = "qwen2.5-7b-as-llama"
# name -> (transformers class, the sizes of shapes.MODELS' model, what else its published config.json sets that the
# class's defaults do not).  One model of each family with sizes of its own (Mistral-7B's layers are Llama-3-8B's).
ARCHITECTURES = {
    DEFAULT: ("Llama", "Qwen2.5-7B", dict(vocab_size=152064)),
    "llama-3-8b": ("Llama", "Llama-3-8B", dict(vocab_size=128256, rope_theta=500000.0)),
    "qwen2.5-14b": ("Qwen2", "Qwen2.5-14B", dict(vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6)),
    "gemma-2-9b": ("Gemma2", "Gemma-2-9B", dict(vocab_size=256000, query_pre_attn_scalar=256)),  # tied head
    "phi-3-mini": ("Phi3", "Phi-3-mini", dict(vocab_size=32064)),
}


def build_config(name: str, layers: int, **overrides):
    """The transformers config of ``ARCHITECTURES[name]`` with ``layers`` decoder layers (and ``overrides``)."""
    family, sizes, extra = ARCHITECTURES[name]
    m = next(m for m in MODELS if m.name == sizes)
    fields = dict(hidden_size=m.hidden, intermediate_size=m.intermediate, num_attention_heads=m.heads,
                  num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_hidden_layers=layers,
                  max_position_embeddings=4096, **extra)
    return getattr(transformers, f"{family}Config")(**(fields | overrides))


def build_model(name: str, layers: int, **overrides):
    family = ARCHITECTURES[name][0]
    return getattr(transformers, f"{family}ForCausalLM")(build_config(name, layers, **overrides))


def timings(graph: dict[str, float], eager: dict[str, float]) -> dict:
    """ms of each model, and speedups over dense: kp.sparsify's default ("sparse"), and beside it unfused, and
    against the dense model grouped alike."""
    row = {}
    for mode, t in (("graph", graph), ("eager", eager)):
        row |= {f"{mode}_{name.replace(' ', '_')}_ms": ms * 1e3 for name, ms in t.items()}
        row[f"{mode}_speedup"] = t["dense"] / t["sparse"]
        if "sparse unfused" in t:
            row[f"{mode}_speedup_unfused"] = t["dense"] / t["sparse unfused"]
            row[f"{mode}_speedup_vs_dense_fused"] = t["dense fused"] / t["sparse"]
            row[f"{mode}_dense_fused_speedup"] = t["dense"] / t["dense fused"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT, choices=sorted(ARCHITECTURES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory", default="compact", choices=("compact", "fast"))
    ap.add_argument("--profile", action="store_true", help="split each case's device time by kernel class")
    ap.add_argument("--tune", action="store_true",
                    help="tune the 2:4 model's tiles at n = 32, 128 and 512 (kp.warmup(tune=True)) after its "
                         "first pass, before any timing")
    ap.add_argument("--no-siblings", dest="siblings", action="store_false",
                    help="time dense and kp.sparsify's model unfused only, as before 0024")
    a = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, where the CPU takes a minute at these sizes
        dense = build_model(a.model, a.layers).to(torch.bfloat16).eval()
    cfg = dense.config
    sparse = copy.deepcopy(dense)
    # The LM head pruned too, as issue 26's measurement and sparse24-model-*.json did (sparsify's default keeps it
    # dense); a head tied to the embeddings (Gemma-2's) stays dense either way.
    report = kp.sparsify(sparse, progress=False, prune_output=True, fuse=False)
    out = {"head_pruned": "lm_head" in report.converted}
    # At 4 layers the head weighs far more than in the whole model: its share of the dense linear weights' bytes.
    linear = {n: mod.weight.nbytes for n, mod in dense.named_modules() if isinstance(mod, torch.nn.Linear)}
    out["head_share_of_linear_bytes"] = linear["lm_head"] / sum(linear.values())
    for mod in sparse.modules():
        if isinstance(mod, Sparse24Linear):
            mod.memory = a.memory
    masked = copy.deepcopy(dense)
    # kp.sparsify's default runs q/k/v and gate/up as one GEMM each (kp.nn.fuse_siblings); the same grouping of the
    # dense model's layers tells what the grouping gives and what 2:4 gives.
    models = {"dense": dense, "sparse": sparse}
    if a.siblings:
        models["sparse unfused"] = copy.deepcopy(sparse)
        fuse_siblings(sparse)
        models["dense fused"] = fused = copy.deepcopy(dense)
        for name, mod in list(fused.named_modules()):
            if type(mod) is torch.nn.Linear and name != "lm_head":
                SiblingLinear.adopt(fused, name, mod)
        fuse_siblings(fused)
    rows = []
    with torch.inference_mode():
        for name in report.converted:
            masked.get_submodule(name).weight.copy_(sparse.get_submodule(name).to_dense())
        probe = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
        got, want = sparse(probe).logits.float(), masked(probe).logits.float()
        out["logits_rel_err_vs_masked_dense"] = err = float((got - want).abs().max() / want.abs().max())
        del masked
        print(f"{report.summary().splitlines()[0]}; logits vs masked-dense rel err {err:.1e}", flush=True)
        if a.tune:  # after the first pass, which settles the sibling groups whose GEMMs are tuned too
            t0 = time.perf_counter()
            warm = kp.warmup(sparse, (32, 128, 512), progress=False, tune=True)
            out["tune_s"] = time.perf_counter() - t0
            out["tiles"] = [{key: r[key] for key in ("m", "k", "n", "config", "tile", "epilogue") if key in r}
                            for r in warm if "tile" in r]
            print(f"tuned in {out['tune_s']:.1f} s:", *(f"{r['m']}x{r['k']} n={r['n']}: {r['tile']}"
                                                         for r in out["tiles"]), sep="\n  ", flush=True)
        for batch in (1, 32, 128):
            prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device="cuda")
            steps = {n: DecodeStep(m, prompt, 16 + 16 + 8 * (a.rounds + 2) * 2) for n, m in models.items()}
            graphs = {n: GraphedDecode(s) for n, s in steps.items()}
            check = max(g.check() for g in graphs.values())
            graph = interleaved({n: lambda g=g: g.replay_seconds(4) for n, g in graphs.items()}, a.rounds, 1)
            eager = interleaved({n: lambda s=s: wall_seconds(s) for n, s in steps.items()}, a.rounds, 3)
            rows.append({"case": f"decode batch {batch}", **timings(graph, eager), "replay_vs_eager_rel_err": check})
            if a.profile:
                rows[-1]["device_ms_by_kernel"] = {n: kernel_split(s) for n, s in steps.items()}
            print(rows[-1], flush=True)
            del graphs, steps
        for tokens in (512,):
            ids = torch.randint(0, cfg.vocab_size, (1, tokens), device="cuda")
            # No cache: each call would build its own, and a sliding-window layer's (Gemma-2's) first write copies
            # a CPU tensor to the GPU, which a capture refuses.  The forward over the prompt, for every model alike.
            graphs = {n: Graphed(lambda m=m: m(ids, use_cache=False).logits) for n, m in models.items()}
            check = max(g.check() for g in graphs.values())
            graph = interleaved({n: lambda g=g: g.replay_seconds(3) for n, g in graphs.items()}, a.rounds, 1)
            eager = interleaved({n: lambda m=m: wall_seconds(lambda: m(ids, use_cache=False))
                                 for n, m in models.items()}, a.rounds, 3)
            rows.append({"case": f"prefill {tokens}", **timings(graph, eager), "replay_vs_eager_rel_err": check})
            if a.profile:
                rows[-1]["device_ms_by_kernel"] = {n: kernel_split(lambda m=m: m(ids, use_cache=False))
                                                   for n, m in models.items()}
            print(rows[-1], flush=True)
            del graphs
    from kernelplan.sparse24.gemm import fast_path_backends

    out["backends"] = fast_path_backends()
    out["weight_bytes"] = {name: weight_bytes(m) for name, m in models.items()}  # each storage once: groups are views
    out["sibling_calls"] = {name: _sibling_calls(m) for name, m in models.items() if "fused" in name or name == "sparse"}
    print("sibling calls:", out["sibling_calls"])
    out["dense_weight_bytes"], out["sparse_weight_bytes"] = weight_bytes(dense), weight_bytes(sparse)
    out["sparse_over_dense_bytes"] = out["sparse_weight_bytes"] / out["dense_weight_bytes"]
    print(f"weights: dense {out['dense_weight_bytes'] / 2**30:.2f} GiB, sparse {out['sparse_weight_bytes'] / 2**30:.2f} "
          f"GiB ({out['sparse_over_dense_bytes']:.3f}x)")
    family, sizes, _ = ARCHITECTURES[a.model]
    kind = "sparse24-model" if a.model == DEFAULT else f"sparse24-model-{a.model}"
    results.write(kind, {"rows": rows, **out}, a.out, transformers=transformers.__version__,
                  model="Llama with Qwen2.5-7B sizes" if a.model == DEFAULT else f"{family} with {sizes}'s sizes",
                  architecture=a.model, layers=a.layers, memory=a.memory, tuned=a.tune)
    return 0


if __name__ == "__main__":
    sys.exit(main())
