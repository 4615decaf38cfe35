"""A 2:4 directory loaded by transformers' own ``from_pretrained`` (kernelplan's registered quantizer) and by
``kp.hf.load_model``, against the dense directory's ``from_pretrained``: GPU memory, load time and agreement.

``--model llama``: a Llama with Qwen2.5-7B's sizes (hidden 3584, intermediate 18944, 28 heads, 4 KV heads, vocabulary
152064, untied LM head); ``--model mixtral``: Mixtral-8x7B's (hidden 4096, 8 experts of 14336, top 2, 32 heads, 8 KV
heads, vocabulary 32000), its experts 2:4 too (``experts="all"``).  ``--layers`` decoder layers, random bf16 weights,
no download.  ``kp.sparsify`` (magnitude, LM head dense) prunes a copy; both are written with ``save_pretrained``
(a MoE model's 2:4 experts one layer an expert, under transformers' saved names), and for a MoE model the 2:4 one
with ``kp.hf.save_model`` too (its experts stacked).  ``kp.sparsify``'s own peak on the GPU is reported: ``sparsify``,
the memory it allocated over the dense model it started from.  Each directory is then loaded onto the GPU
in turn (``device_map="cuda"``; ``load_model(device="cuda")``), and for each: wall seconds of the load, GPU memory it
holds after a forward at 1 and at 128 tokens (``torch.cuda.memory_allocated``, and ``weight_bytes``: parameters,
buffers and the 2:4 layouts calls built), its peak during the load, and the linear layers' bytes against their dense
bytes (a MoE layer's experts counted among them).  Each sparse loader's state_dict is compared bit for bit with the
sparsified model's before it was saved, and the sparse loaders' logits with each other.  (Logits against the model
before saving differ in bf16 by its rotary buffer: built in float32 and cast, it is bf16 there, and float32 in a model
loaded in bf16.)  transformers' loader runs in threads unless ``HF_DEACTIVATE_ASYNC_LOAD=1`` (its switch), which the
results record as ``async_load``.  Writes ``bench/results/hf-from-pretrained-<gpu>.json``
(``hf-from-pretrained-mixtral-<gpu>.json``; ``-sync`` before the GPU's name without the threads).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/hf_from_pretrained.py [--model mixtral]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers.utils.import_utils import is_env_variable_true

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import weight_bytes


def _linear_bytes(model) -> tuple[int, int]:
    """(bytes the decoder's linear layers and dense experts hold, as held, 2:4 layouts their calls built included;
    their dense bytes)."""
    from kernelplan.nn.experts import experts_reason

    held = dense = 0
    for name, mod in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if experts_reason(mod) is None:  # a dense experts module's 3-D weights
            weights = sum(p.nbytes for p in mod.parameters(recurse=False) if p.dim() == 3)
            held, dense = held + weights, dense + weights
        elif isinstance(mod, kp.nn.Sparse24Linear):
            w = mod.weight24
            held += mod.values.nbytes + mod.metadata.nbytes + sum(w.derived_bytes().values())
            dense += mod.out_features * mod.in_features * mod.values.element_size()
        elif isinstance(mod, torch.nn.Linear):
            held += mod.weight.nbytes
            dense += mod.weight.nbytes
    return held, dense


def _load(name: str, fn, ids: torch.Tensor, saved: dict[str, torch.Tensor] | None) -> tuple[dict, torch.Tensor]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    with torch.inference_mode():
        logits = model(ids).logits.float().cpu()
        model(torch.zeros(1, 128, dtype=ids.dtype, device=ids.device))
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - base  # before the state_dict below: it unpacks each 2:4 layer
    held, dense = _linear_bytes(model)
    state = model.state_dict()
    equal = None if saved is None else state.keys() == saved.keys() and all(
        state[k].dtype == saved[k].dtype and torch.equal(state[k].cpu(), saved[k]) for k in saved)
    row = {"state_dict_equal_to_saved": equal, "loader": name, "seconds": seconds, "allocated_after_calls": allocated,
           "peak_during_load": peak, "weight_bytes": weight_bytes(model), "linear_bytes": held,
           "linear_dense_bytes": dense, "linear_ratio": held / dense,
           "sparse24_layers": sum(isinstance(m, kp.nn.Sparse24Linear) for m in model.modules()),
           "layouts": sorted({m.layout for m in model.modules() if isinstance(m, kp.nn.Sparse24Linear)})}
    del model, state
    return row, logits


CONFIGS = {
    "llama": lambda layers: transformers.LlamaConfig(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False),
    "mixtral": lambda layers: transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=4096, tie_word_embeddings=False),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 for llama, 2 for mixtral)")
    ap.add_argument("--dir", default=None, help="where to write the two directories (default: a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # transformers' loader reads the checkpoint onto the device in threads ahead of the thread that sets each tensor,
    # unless this is set: a load's peak depends on it (docs/design/0047).
    async_load = not is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD")
    torch.manual_seed(0)
    layers = a.layers or {"llama": 4, "mixtral": 2}[a.model]
    cfg = CONFIGS[a.model](layers)
    moe = a.model == "mixtral"
    root = Path(a.dir or tempfile.mkdtemp())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), device="cuda")
    with torch.device("cuda"):  # initialized on the GPU: on the CPU, random init of billions of weights takes minutes
        dense = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    dense.save_pretrained(root / "dense")
    sparse = copy.deepcopy(dense)
    del dense
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    report = kp.sparsify(sparse, progress=False, experts="all" if moe else "auto")
    torch.cuda.synchronize()
    sparsify = {"seconds": time.perf_counter() - t0, "allocated_before": before,
                "allocated_after": torch.cuda.memory_allocated(),
                "peak_over_before": torch.cuda.max_memory_allocated() - before}
    print({"kp.sparsify on the GPU": sparsify}, flush=True)
    with torch.inference_mode():
        ref = sparse(ids).logits.float().cpu()
    saved = {k: v.cpu() for k, v in sparse.state_dict().items()}
    sparse.save_pretrained(root / "sparse")
    if moe:
        kp.hf.save_model(sparse, root / "stacked")
    del sparse
    dirs = ["dense", "sparse", "stacked"] if moe else ["dense", "sparse"]
    sizes = {d: sum(f.stat().st_size for f in (root / d).glob("*.safetensors")) for d in dirs}
    kp.hf.register_quantizer()
    loaders = {
        "dense, from_pretrained": lambda: transformers.AutoModelForCausalLM.from_pretrained(
            root / "dense", device_map="cuda", dtype=torch.bfloat16),
        "2:4, from_pretrained": lambda: transformers.AutoModelForCausalLM.from_pretrained(
            root / "sparse", device_map="cuda", dtype=torch.bfloat16),
        "2:4, kp.hf.load_model": lambda: kp.hf.load_model(root / "sparse", device="cuda"),
    }
    if moe:
        loaders["2:4 experts stacked, from_pretrained"] = lambda: transformers.AutoModelForCausalLM.from_pretrained(
            root / "stacked", device_map="cuda", dtype=torch.bfloat16)
    rows, logits = [], {}
    for name, fn in loaders.items():
        row, logits[name] = _load(name, fn, ids, saved if "2:4" in name else None)
        rows.append(row)
        print(row, flush=True)
    scale = float(ref.abs().max())
    agreement = {name: float((logits[name] - ref).abs().max()) / scale for name in loaders if "2:4" in name}
    same = all(torch.equal(logits["2:4, from_pretrained"], logits[name]) for name in loaders if "2:4" in name)
    print({"relative max error against the model before saving": agreement, "the 2:4 loaders equal": same})
    ok = same and all(row["state_dict_equal_to_saved"] for row in rows[1:])
    if not ok:
        print("a 2:4 loader's state_dict or logits differ from the saved model's", file=sys.stderr)
    dense_row = rows[0]
    for row in rows[1:]:
        row["allocated_over_dense"] = row["allocated_after_calls"] / dense_row["allocated_after_calls"]
        row["weight_bytes_over_dense"] = row["weight_bytes"] / dense_row["weight_bytes"]
    name = "hf-from-pretrained" if a.model == "llama" else f"hf-from-pretrained-{a.model}"
    name += "" if async_load else "-sync"
    results.write(name, {"rows": rows, "model": a.model, "layers": layers, "file_bytes": sizes,
                         "async_load": async_load, "relative_error": agreement, "loaders_equal": same,
                         "converted": len(report.converted), "sparsify": sparsify}, a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
