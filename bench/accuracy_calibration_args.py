"""Calibration's per-block arguments, measured: a trained model whose blocks take arguments of their own (Gemma-3's
sliding and global attention layers), pruned to 2:4 with calibration, held-out perplexity by method and source tree.

Until 51e3e08, calibration ran every block on the first block's captured arguments: Gemma-3's global layers under
the sliding-window mask and the local rotary tables (docs/design/0079 §5).  This bench trains a small byte-level
Gemma-3 on the Debian documentation corpus (``kernelplan/bench/accuracy.py``: 12 layers of 256, five sliding layers
of window 32 then a global one, twice; windows of 256 bytes), then prunes it with each method, on the CPU in
float32, with whichever kernelplan is on ``PYTHONPATH``, and records the perplexities under ``--tree``:

    PYTHONPATH=src python bench/accuracy_calibration_args.py --train /tmp/gemma3 --steps 1600   # on a GPU
    git archive 51e3e08^ src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python bench/accuracy_calibration_args.py --model /tmp/gemma3 --tree "51e3e08^"
    PYTHONPATH=src python bench/accuracy_calibration_args.py --model /tmp/gemma3 --tree HEAD

Each run adds its tree's rows to ``bench/results/accuracy-calibration-args-cpu.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench.accuracy import SEQ, calibration, corpus

OUT = os.path.join(os.path.dirname(__file__), "results", "accuracy-calibration-args-cpu.json")
LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 2


def config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=32, layer_types=LAYER_TYPES,
        max_position_embeddings=SEQ, rope_theta=1e6, tie_word_embeddings=True, query_pre_attn_scalar=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def train(out: str, steps: int, device: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from train_tiny_lm import train_lm

    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config()).to(device)
    data, held = corpus()
    best, log = train_lm(model, data, held, steps, 64, 2e-3, max(10, steps // 10))
    model.load_state_dict(best[1])
    model.to(torch.bfloat16).save_pretrained(out)
    with open(os.path.join(out, "train-log.json"), "w") as f:
        json.dump(dict(best_step=best[2], best_perplexity=best[0], steps=steps, log=log), f, indent=1)


def measure(model_dir: str, held_windows: int, methods: tuple[str, ...]) -> dict:
    dense = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data, held = corpus()
    calib = calibration(data)
    held = held[: held_windows * SEQ].view(held_windows, SEQ)
    rows = {"dense": {"perplexity": kp.evaluate(dense, held)}}
    print("dense", rows["dense"], flush=True)
    for method in methods:
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        kp.sparsify(model, method=method, calibration=None if method == "magnitude" else calib, progress=False)
        rows[method] = {"perplexity": kp.evaluate(model, held), "prune_seconds": time.perf_counter() - start}
        print(method, rows[method], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", help="train the model into this directory (then stop)")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="the trained model's directory")
    ap.add_argument("--tree", help="the name of the kernelplan source tree this run measures")
    ap.add_argument("--held-out", type=int, default=1000, help="held-out windows of SEQ bytes")
    ap.add_argument("--methods", nargs="*", default=["magnitude", "wanda", "sparsegpt"])
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    if a.train:
        train(a.train, a.steps, a.device)
        return 0
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    rows = measure(a.model, a.held_out, tuple(a.methods))
    doc = json.load(open(a.out)) if os.path.exists(a.out) else {"trees": {}}
    log = os.path.join(a.model, "train-log.json")
    doc["meta"] = {"device": f"cpu ({os.cpu_count()} CPUs)", "torch": torch.__version__,
                   "transformers": transformers.__version__, "model": "byte-level Gemma-3, " + json.dumps(
                       {k: v for k, v in config().to_dict().items() if k in ("hidden_size", "num_hidden_layers",
                                                                             "sliding_window", "intermediate_size")}),
                   "layer_types": LAYER_TYPES, "seq": SEQ, "held_out_windows": a.held_out,
                   "training": json.load(open(log)) if os.path.exists(log) else None}
    doc["trees"][a.tree] = {"kernelplan": os.path.dirname(kp.__file__), "date": time.strftime("%Y-%m-%d"),
                            "commit": os.environ.get("KERNELPLAN_COMMIT", "unknown"), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
