"""A Llama-3-70B-shaped model on one GPU, dense and 2:4: the GPU memory each holds, whether it fits, and a decode step.

80 decoder layers with Llama-3-70B's published sizes (hidden 8192, intermediate
28672, 64 heads, 8 KV heads, vocabulary 128256), random bf16 weights, no
download.  Each model is built one decoder layer at a time on the GPU (the
sparse one prunes and compresses each layer's linears there, ``kp.sparsify``,
before building the next), each in a process of its own, so that nothing one
left behind counts against the other.  For each: the bytes of its weights, whether it fits, and if it does, one
greedy decode step at batch 1 after a 128-token prompt, replayed as a CUDA graph
(the two models in turn, not alternating: they do not fit together), and the
KV-cache tokens the memory left over would hold.  Writes
``bench/results/sparse24-70b-memory-<gpu>.json``.

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
from kernelplan.nn import Sparse24Linear

GiB = 2**30


def config(layers: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                                    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def build(cfg, sparse: bool, device: str = "cuda"):
    """The model on the GPU, built a decoder layer at a time; None if it does not fit (and the bytes it reached)."""
    from transformers.models.llama import modeling_llama as ml

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        with torch.device(device):
            model.model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            model.model.norm = ml.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            model.model.rotary_emb = ml.LlamaRotaryEmbedding(config=cfg)
            model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            for i in range(cfg.num_hidden_layers):
                layer = ml.LlamaDecoderLayer(cfg, layer_idx=i)
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


def measure(cfg, sparse: bool, prompt_len: int, steps: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model, reached = build(cfg, sparse)
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    with torch.device("meta"):
        needed = sum(p.numel() * 2 for p in transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).parameters())
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
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("sparse", "dense"), help="measure one model and print its JSON (a child run)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.only:
        print("RESULT " + json.dumps(measure(config(a.layers), a.only == "sparse", a.prompt, a.steps)))
        return 0
    result = {}
    for which in ("sparse", "dense"):
        child = subprocess.run([sys.executable, __file__, "--only", which, "--layers", str(a.layers), "--prompt",
                                str(a.prompt), "--steps", str(a.steps)], capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
        if child.returncode or not lines:
            print(child.stdout[-2000:], child.stderr[-4000:])
            return 1
        result[which] = json.loads(lines[-1][7:])
    results.write("sparse24-70b-memory", result, a.out, transformers=transformers.__version__,
                  model="Llama-3-70B sizes, random bf16 weights", layers=a.layers, prompt=a.prompt,
                  decode="batch 1, one greedy step replayed as a CUDA graph, median of --steps replays; the models "
                         "in turn (they do not fit together)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
