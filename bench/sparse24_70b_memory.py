"""A Llama-3-70B- or Llama-4-Scout-shaped model on one GPU, dense and 2:4: the GPU memory each holds, whether it fits,
and a decode step.

``--model llama-3-70b`` (the default): 80 decoder layers with Llama-3-70B's published sizes (hidden 8192,
intermediate 28672, 64 heads, 8 KV heads, vocabulary 128256).  ``--model llama-4-scout``: Llama-4-Scout-17B-16E's
text model (48 layers, hidden 5120, 40 heads, 8 KV heads, 16 experts of 8192 and a shared one in every layer,
vocabulary 202048: 108B parameters).  Random bf16 weights, no download.  Each model is built one decoder layer at a
time on the GPU (the sparse one prunes and compresses each layer's linears there, ``kp.sparsify``, before building the
next), each in a process of its own, so that nothing one left behind counts against the other.  For each: the bytes
of its weights, whether it fits, and if it does, one greedy decode step at batch 1 after a 128-token prompt, replayed
as a CUDA graph (the two models in turn, not alternating: they do not fit together), and the KV-cache tokens the
memory left over would hold.  Writes
``bench/results/sparse24-70b-memory-<gpu>.json`` (``sparse24-llama4-scout-memory-<gpu>.json``).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_70b_memory.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import DecodeStep, GraphedDecode, weight_bytes
from kernelplan.nn import Sparse24Experts, Sparse24Linear

GiB = 2**30


def _llama3(layers: int):
    return transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def _llama4_scout(layers: int):  # meta-llama/Llama-4-Scout-17B-16E's text_config
    return transformers.Llama4TextConfig(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                                         num_hidden_layers=layers, num_attention_heads=40, num_key_value_heads=8,
                                         head_dim=128, vocab_size=202048, num_local_experts=16, num_experts_per_tok=1,
                                         interleave_moe_layer_step=1, rope_theta=500000.0, attention_chunk_size=8192,
                                         tie_word_embeddings=False)


# --model -> (its config for a number of layers, its default layers, its causal LM class, its modelling module's
# decoder layer, norm and rotary embedding, the results' name)
MODELS = {
    "llama-3-70b": (_llama3, 80, "LlamaForCausalLM", "llama", ("LlamaDecoderLayer", "LlamaRMSNorm",
                                                               "LlamaRotaryEmbedding"), "sparse24-70b-memory"),
    "llama-4-scout": (_llama4_scout, 48, "Llama4ForCausalLM", "llama4", ("Llama4TextDecoderLayer", "Llama4TextRMSNorm",
                                                                         "Llama4TextRotaryEmbedding"),
                      "sparse24-llama4-scout-memory"),
}




def _random_experts(layer: torch.nn.Module) -> None:
    """Llama-4's experts module leaves gate_up_proj zero and down_proj uninitialized: random weights, as nn.Linear's."""
    for module in layer.modules():
        if type(module).__name__ == "Llama4TextExperts":
            with torch.no_grad():
                module.gate_up_proj.normal_(0, module.gate_up_proj.shape[1] ** -0.5)
                module.down_proj.normal_(0, module.down_proj.shape[1] ** -0.5)


def build(name: str, cfg, sparse: bool, device: str = "cuda"):
    """Model ``name`` of config ``cfg`` on the GPU, built a decoder layer at a time; None if it does not fit (and the
    bytes it reached)."""
    import importlib

    _, _, causal, family, (decoder, norm, rotary), _ = MODELS[name]
    ml = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = getattr(transformers, causal)(cfg)
        with torch.device(device):
            model.model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            model.model.norm = getattr(ml, norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
            model.model.rotary_emb = getattr(ml, rotary)(config=cfg)
            model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            for i in range(cfg.num_hidden_layers):
                layer = getattr(ml, decoder)(cfg, layer_idx=i)
                _random_experts(layer)
                if sparse:
                    kp.sparsify(layer, progress=False)
                model.model.layers[i] = layer
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"not built on the GPU: {left[:3]}")
        return model.eval(), None
    except torch.OutOfMemoryError:
        reached = torch.cuda.memory_allocated()
        model = layer = None
        torch.cuda.empty_cache()
        return None, reached
    finally:
        torch.set_default_dtype(torch.float32)


def measure(name: str, layers: int, sparse: bool, prompt_len: int, steps: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    cfg = MODELS[name][0](layers)
    model, reached = build(name, cfg, sparse)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    with torch.device("meta"):
        needed = sum(p.numel() * 2 for p in getattr(transformers, MODELS[name][2])(cfg).parameters())
    out = {"build_s": time.time() - t0, "kv_bytes_per_token": kv_per_token, "dense_weight_gib": needed / GiB,
           "device_total_gib": torch.cuda.mem_get_info()[1] / GiB}
    if model is None:
        out.update(fits=False, allocated_when_it_failed_gib=reached / GiB)
        print(f"{'sparse' if sparse else 'dense'}: does not fit; {reached / GiB:.1f} GiB allocated when it failed",
              flush=True)
        return out
    out.update(fits=True, weight_gib=weight_bytes(model) / GiB, allocated_gib=torch.cuda.memory_allocated() / GiB)
    if sparse:
        out["sparse24_layers"] = sum(isinstance(m, Sparse24Linear) for m in model.modules())
        out["sparse24_experts"] = sum(isinstance(m, Sparse24Experts) for m in model.modules())
    try:
        with torch.inference_mode():
            prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
            step = DecodeStep(model, prompt, prompt_len + steps + 16)
            graph = GraphedDecode(step)
            out["replay_vs_eager_rel_err"] = graph.check()
            times = sorted(graph.replay_seconds(1) for _ in range(steps))
            out["decode_step_ms"] = times[len(times) // 2] * 1e3
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        free = torch.cuda.mem_get_info()[0]
        out["free_after_step_gib"] = free / GiB
        out["kv_tokens_that_fit_in_free"] = free // kv_per_token
        del graph, step
    except torch.OutOfMemoryError as e:
        out["decode_step"] = f"out of memory: {str(e).splitlines()[0]}"
    print(f"{'sparse' if sparse else 'dense'}: {json.dumps(out)}", flush=True)
    del model
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="llama-3-70b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("sparse", "dense"), help="measure one model and print its JSON (a child run)")
    a = ap.parse_args()
    layers = a.layers or MODELS[a.model][1]
    torch.manual_seed(0)
    if a.only:
        print("RESULT " + json.dumps(measure(a.model, layers, a.only == "sparse", a.prompt, a.steps)))
        return 0
    result = {}
    for which in ("sparse", "dense"):
        child = subprocess.run([sys.executable, __file__, "--only", which, "--model", a.model, "--layers", str(layers),
                                "--prompt", str(a.prompt), "--steps", str(a.steps)], capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not lines:
            print(child.stdout[-2000:], child.stderr[-4000:])
            return 1
        result[which] = json.loads(lines[-1][7:])
    described = {"llama-3-70b": "Llama-3-70B sizes", "llama-4-scout": "Llama-4-Scout-17B-16E's text model's sizes"}
    results.write(MODELS[a.model][5], result, a.out, transformers=transformers.__version__,
                  model=f"{described[a.model]}, random bf16 weights", layers=layers, prompt=a.prompt,
                  decode="batch 1, one greedy step replayed as a CUDA graph, median of --steps replays; the models "
                         "in turn (they do not fit together)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
