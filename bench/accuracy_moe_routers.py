"""A MoE router that is a linear layer, pruned to 2:4 or kept dense: what it costs a trained model's perplexity.

``kp.sparsify`` keeps a MoE block's routers that are plain ``nn.Linear`` layers dense (Hunyuan-MoE's ``gate.wg``,
DBRX's ``router.layer``, Qwen-MoE's ``shared_expert_gate``; ``pruning/sparsify.py``'s ``_router_of``).  Here a
byte-level Hunyuan-MoE (``CONFIG``: 8 experts, top 2, a shared MLP) is trained on the accuracy benchmark's corpus
(the recipe of ``train_tiny_lm.py``), then pruned by each method with ``experts="all"``: once as sparsify does, once
with the routers pruned as well (``_router_of`` replaced for that run, as sparsify before 54d0851 did).  Held-out
perplexity per byte (bf16, the whole held-out split) and how many tokens' chosen experts changed against the dense
model are reported.  Writes ``bench/results/accuracy-moe-routers-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/accuracy_moe_routers.py
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.accuracy import SEQ, calibration
from accuracy_moe import setup
from train_tiny_lm import train_lm

sparsify_module = importlib.import_module("kernelplan.pruning.sparsify")  # the package's name is the function

CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_experts=8, moe_topk=2,
              max_position_embeddings=SEQ, tie_word_embeddings=True)


@contextlib.contextmanager
def routers_pruned():
    """sparsify with no layer taken for a router: the routers pruned as any linear layer."""
    keep = sparsify_module._router_of
    sparsify_module._router_of = lambda model, name, layer: None
    try:
        yield
    finally:
        sparsify_module._router_of = keep


def chosen_experts(model, ids: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts in every layer, sorted: ``[tokens, layers x k]``, from each router's logits."""
    picks, hooks = [], []
    for name, mod in model.named_modules():
        if name.endswith("gate.wg"):
            hooks.append(mod.register_forward_hook(lambda m, args, out: picks.append(torch.topk(
                out.float().reshape(-1, out.shape[-1]), CONFIG["moe_topk"], dim=-1).indices.sort(-1).values)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(picks, dim=-1)


def main() -> int:
    a, dev, train, held = setup(800)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("hunyuan_v1_moe", **CONFIG)).to(dev)
    t0 = time.perf_counter()
    best, log = train_lm(model, train, held, a.steps, a.batch, 2e-3, max(1, a.steps // 4))
    trained_s = time.perf_counter() - t0
    model.load_state_dict(best[1])
    dense = model.to(torch.bfloat16).eval()
    calib = calibration(train, a.windows)
    probe = held[:32 * SEQ].view(32, SEQ).to(dev)
    want = chosen_experts(dense, probe)
    base = kp.evaluate(dense, held, seq_len=SEQ)
    rows = [dict(method="dense", routers="dense", perplexity=base, increase=0.0, routed_alike=1.0)]
    print(f"trained {a.steps} steps in {trained_s:.0f} s; dense held-out perplexity {base:.3f}", flush=True)
    for method in ("magnitude", "wanda", "sparsegpt"):
        for routers in ("dense", "pruned"):
            pruned = copy.deepcopy(dense)
            with routers_pruned() if routers == "pruned" else contextlib.nullcontext():
                report = kp.sparsify(pruned, method=method, calibration=calib, progress=False, experts="all")
            gates = [n for n in report.converted if n.endswith("gate.wg")]
            assert bool(gates) == (routers == "pruned"), gates
            ppl = kp.evaluate(pruned, held, seq_len=SEQ)
            alike = float((chosen_experts(pruned, probe) == want).all(-1).float().mean())
            rows.append(dict(method=method, routers=routers, perplexity=ppl, increase=ppl - base, routed_alike=alike,
                             converted=len(report.converted)))
            print(f"{method:10s} routers {routers:6s} perplexity {ppl:.3f} ({ppl - base:+.3f}); tokens whose experts "
                  f"in every layer are the dense model's: {alike:.1%}", flush=True)
            del pruned
    results.write("accuracy-moe-routers", {"rows": rows, "train_log": log, "best_step": best[2],
                                           "trained_seconds": trained_s, "config": CONFIG}, a.out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
