"""Where a Hugging Face decode step spends its time, dense against sparsified: torch.profiler tables.

python bench/llama_profile.py [--batch 1] [--tokens 8] [--rows 15]

The model is ``kernelplan bench llama``'s (Llama-3-8B layer sizes, 2 decoder
layers, bf16).  After a warm-up ``generate`` (kernels compiled, 2:4 dispatch
tuned), one profiled ``generate`` per model prints its ops by self CPU time and
by CUDA time, and the wall time per token.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import kernelplan as kp
from kernelplan.bench.llama import _config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rows", type=int, default=15)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(_config(transformers, True)).to(dev, torch.bfloat16).eval()
    sparse = copy.deepcopy(dense)
    kp.sparsify(sparse, progress=False, prune_output=True)  # the LM head too, as bench/llama.py
    prompt = torch.randint(0, dense.config.vocab_size, (a.batch, 128), device=dev)

    def decode(m):
        return m.generate(prompt, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        for name, m in (("dense", dense), ("sparse", sparse)):
            decode(m)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            decode(m)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.tokens
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                decode(m)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            cuda_us = sum(e.self_device_time_total for e in ka) / a.tokens
            print(f"\n=== {name}: {wall * 1e3:.2f} ms per token unprofiled; CUDA {cuda_us / 1e3:.2f} ms per token")
            print(ka.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))
            print(ka.table(sort_by="self_device_time_total", row_limit=a.rows // 2, max_name_column_width=60))


if __name__ == "__main__":
    main()
