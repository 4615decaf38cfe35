"""kernelplan's SparseGPT and Wanda beside llm-compressor's, on the trained test model, same calibration data.

llm-compressor 0.14.0.1 installs beside torch 2.13 (with transformers 5.17 and
compressed-tensors 0.19, not kernelplan's test pins), so this runs in a venv of
its own, on the CPU:

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor
    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) /tmp/llmc/bin/python bench/compare_llmcompressor.py

The same comparison is an optional test there (``/tmp/llmc/bin/pip install pytest``, then
``PYTHONPATH=src /tmp/llmc/bin/python -m pytest tests/test_llmcompressor.py``); it skips elsewhere.

For each method: held-out perplexity per byte of each library's pruned model,
and per layer the share of the 2:4 mask both keep.  ``oneshot`` also rewrites
the embedding and LM head (tied in this model), which neither method prunes:
those are restored from the dense model, and listed, so that only the pruned
linears differ.  Writes
``bench/results/llmcompressor-compare-cpu.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

import kernelplan as kp
from kernelplan.bench import accuracy, environment


def masks(model) -> dict[str, torch.Tensor]:
    """Each pruned linear's keep-mask, from kernelplan's Sparse24Linear or a dense weight with zeros."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, kp.nn.Sparse24Linear):
            out[name] = m.to_dense() != 0
        elif isinstance(m, torch.nn.Linear) and name != "lm_head":
            out[name] = m.weight != 0
    return out


def theirs(dense, calib, method: str):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

    model = copy.deepcopy(dense)
    modifier = (SparseGPTModifier(sparsity=0.5, mask_structure="2:4", dampening_frac=0.01, block_size=128,
                                  targets=["Linear"], ignore=["lm_head"]) if method == "sparsegpt" else
                WandaPruningModifier(sparsity=0.5, mask_structure="2:4", targets=["Linear"], ignore=["lm_head"]))
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    oneshot(model=model, dataset=data, recipe=[modifier], num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], processor=_byte_tokenizer())
    # oneshot also rewrote the (tied) embedding and LM head of this model, which neither method prunes; they
    # are put back, so that the comparison is of the pruned linears alone (and the change is reported).
    changed = {}
    with torch.no_grad():
        for name, t in dense.state_dict().items():
            mine = model.state_dict()[name]
            if not any(name.startswith(n + ".") for n in masks(model)) and not torch.equal(mine, t):
                changed[name] = float((mine - t).abs().max())
                mine.copy_(t)
    return model, changed


def _byte_tokenizer():
    """The model reads bytes and has no tokenizer; oneshot wants one even for a dataset of token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"b{i}": i for i in range(256)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="b0")),
                                   unk_token="b0", pad_token="b0")


def main() -> int:
    train, held = accuracy.corpus()
    calib = accuracy.calibration(train, 32)
    dense = accuracy.load_model("cpu", torch.float32)
    held = held[:accuracy.SEQ * 64]
    out = {"dense_perplexity": kp.evaluate(dense, held, seq_len=accuracy.SEQ), "methods": {}}
    for method in ("sparsegpt", "wanda"):
        ours = copy.deepcopy(dense)
        kp.sparsify(ours, method=method, calibration=calib, progress=False)
        other, restored = theirs(dense, calib, method)
        a, b = masks(ours), masks(other)
        agree = {name: float((a[name] == b[name]).float().mean()) for name in a if name in b}
        density = {name: float(b[name].float().mean()) for name in b}
        out["methods"][method] = {
            "kernelplan_perplexity": kp.evaluate(ours, held, seq_len=accuracy.SEQ),
            "llmcompressor_perplexity": kp.evaluate(other, held, seq_len=accuracy.SEQ),
            "mask_agreement_mean": sum(agree.values()) / len(agree), "mask_agreement_min": min(agree.values()),
            "llmcompressor_density_range": [min(density.values()), max(density.values())],
            "layers": len(agree), "restored_after_oneshot": restored}
        print(method, json.dumps(out["methods"][method]), flush=True)
    import llmcompressor

    env = environment(torch.device("cpu"))
    path = os.path.join(os.path.dirname(__file__), "results", "llmcompressor-compare-cpu.json")
    with open(path, "w") as f:
        json.dump({**env, "llmcompressor": llmcompressor.__version__, "calibration_windows": len(calib),
                   "held_out_bytes": len(held), **out}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
