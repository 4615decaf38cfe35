"""The accuracy table: held-out perplexity of the trained byte-level Llama, dense and pruned by each method, and the
same with outlier features folded in (``kernelplan.bench.accuracy``; ``kernelplan bench accuracy`` prints both).

Writes ``bench/results/accuracy-<gpu>.json``: ``rows`` (the model as trained) and ``outlier_rows`` (after
``fold_outliers(model, OUTLIER_SCALE)``: the same function, a few input channels ``OUTLIER_SCALE`` x larger).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/accuracy_table.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

from kernelplan.bench import accuracy, results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--model-dir", default=str(accuracy.MODEL), help="a save_pretrained Llama (bench/train_tiny_lm.py)")
    ap.add_argument("--corpus", default=str(accuracy.CORPUS), help="the documents the model was trained on")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = accuracy.run(dev, model_dir=a.model_dir, corpus_path=a.corpus)
    folded = accuracy.run(dev, model_dir=a.model_dir, outlier_scale=accuracy.OUTLIER_SCALE, corpus_path=a.corpus)
    for part in (rows, folded):
        print(f"outlier scale {part[0]['outlier_scale']}: input spread median {part[0]['input_spread_median']:.1f}")
        print(accuracy.table(part))
    results.write("accuracy", {"rows": rows, "outlier_rows": folded}, a.json,
                  model=f"{a.model_dir} (byte-level Llama, bf16)",
                  held_out=f"every {accuracy.HELD_OUT_EVERY}th document of {a.corpus.split('/')[-1]}, whole split",
                  calibration=f"{accuracy.CALIBRATION} windows of {accuracy.SEQ} bytes",
                  outliers=f"fold_outliers: 1/64 of the hidden channels x {accuracy.OUTLIER_SCALE:g} in the RMSNorm "
                           f"gains, the q/k/v and gate/up input columns / {accuracy.OUTLIER_SCALE:g}",
                  transformers=transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
