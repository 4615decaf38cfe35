"""Time calibrated pruning of one Llama-3-8B-shaped decoder layer (random weights, bf16) on the GPU.

    PYTHONPATH=src python bench/sparsegpt_layer.py [--sequences 128] [--seq 2048] [--out PATH]

The issue's case: 128 calibration sequences of 2048 tokens.  Each method runs
``kp.sparsify`` on a fresh one-layer LlamaForCausalLM (the same weights), twice:
the first run includes compiling the 2:4 kernels of the pruned pass, the second
is warm.  Reports wall seconds (device drained) and peak GPU memory.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                      max_position_embeddings=args.seq)
    base = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (args.sequences, args.seq))
    rows = []
    for method in ("wanda", "sparsegpt"):
        for run in ("cold", "warm"):
            model = copy.deepcopy(base).cuda()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            report = kp.sparsify(model, method=method, calibration=ids, batch_size=args.batch, progress=False)
            torch.cuda.synchronize()
            rows.append(dict(method=method, run=run, seconds=time.perf_counter() - t0, layers=len(report.converted),
                             phases={k: round(v, 3) for k, v in report.seconds.items()},
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            print(rows[-1], flush=True)
            del model
            torch.cuda.empty_cache()
    results.write("sparsify-layer", {"rows": rows}, args.out, sequences=args.sequences, seq=args.seq,
                  batch=args.batch, shape="Llama-3-8B decoder layer (4096, 14336, 32/8 heads), bf16")


if __name__ == "__main__":
    main()
