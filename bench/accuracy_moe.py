"""Pruning a trained MoE model to 2:4: magnitude, Wanda and SparseGPT, experts included (``pruning/experts.py``).

A byte-level Mixtral (``MOE_CONFIG``: 8 experts, top 2) is trained here on the accuracy benchmark's corpus
(``kernelplan/bench/accuracy.py``, the same recipe as ``train_tiny_lm.py``), then pruned by each method with
``kp.sparsify(..., experts="all")`` on 64 calibration windows of 256 bytes, and its held-out perplexity per byte measured (bf16,
the whole held-out split).  ``experts="none"`` rows prune the attention only: how much of each method's loss the
experts carry.  Writes ``bench/results/accuracy-moe-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/accuracy_moe.py
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
from kernelplan.bench.accuracy import CALIBRATION, SEQ, calibration, corpus
from train_tiny_lm import train_lm

MOE_CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=True, rope_theta=10000.0,
                  num_local_experts=8, num_experts_per_tok=2, output_router_logits=True)


def setup(steps: int):
    """The trained-MoE benches' arguments (``--steps`` defaulting to ``steps``), seeded: ``(args, device, train split,
    held-out split)``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--windows", type=int, default=CALIBRATION, help="calibration windows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--held-out-bytes", type=int, default=None, help="the first this many (default: the whole split)")
    a = ap.parse_args()
    torch.manual_seed(0)
    train, held = corpus()
    return a, torch.device(a.device), train, held[:a.held_out_bytes]


def main() -> int:
    a, dev, train, held = setup(1500)
    cfg = transformers.MixtralConfig(**MOE_CONFIG)
    cfg._experts_implementation = "eager"  # trains in fp32 weights under autocast, one GEMM an expert
    model = transformers.MixtralForCausalLM(cfg).to(dev)
    t0 = time.perf_counter()
    best, log = train_lm(model, train, held, a.steps, a.batch, 2e-3, max(1, a.steps // 5))
    trained_s = time.perf_counter() - t0
    model.load_state_dict(best[1])
    dense = model.to(torch.bfloat16).eval()
    dense.config.output_router_logits = False
    calib = calibration(train, a.windows)
    base = kp.evaluate(dense, held, seq_len=SEQ)
    rows = [dict(model="dense", experts="dense", perplexity=base, increase=0.0, seconds=0.0)]
    print(f"trained {a.steps} steps in {trained_s:.0f} s; dense held-out perplexity {base:.3f}", flush=True)
    for experts in ("all", "none"):
        for method in ("magnitude", "wanda", "sparsegpt"):
            pruned = copy.deepcopy(dense)
            t0 = time.perf_counter()
            report = kp.sparsify(pruned, method=method, calibration=calib, report=True, progress=False,
                                 experts=experts)
            seconds = time.perf_counter() - t0
            ppl = kp.evaluate(pruned, held, seq_len=SEQ)
            expert_errors = [v for k, v in report.errors.items() if "mean over experts" in k]
            rows.append(dict(model=method, experts=experts, perplexity=ppl, increase=ppl - base, seconds=seconds,
                             converted=len(report.converted), uncalibrated=report.uncalibrated,
                             experts_error=sum(expert_errors) / len(expert_errors) if expert_errors else None,
                             bytes_ratio=report.bytes_after / report.bytes_before))
            r = rows[-1]
            print(f"{method:10s} experts={experts:4s} perplexity {ppl:.3f} ({ppl - base:+.3f})  experts' mean output "
                  f"error {r['experts_error'] if r['experts_error'] is not None else float('nan'):.4f}  "
                  f"{seconds:.1f} s", flush=True)
            del pruned
    results.write("accuracy-moe", {"rows": rows, "train_log": log, "best_step": best[2], "trained_seconds": trained_s,
                                   "config": MOE_CONFIG}, a.out, dtype="bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
