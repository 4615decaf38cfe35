"""Optional: kernelplan's Wanda and SparseGPT beside llm-compressor's, on the trained test model.

llm-compressor pins other transformers and compressed-tensors versions than kernelplan's
test extra, so it runs in a venv of its own (``bench/compare_llmcompressor.py`` says how);
everywhere else this file skips.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")
pytest.importorskip("datasets")

import kernelplan as kp  # noqa: E402
from kernelplan.bench import accuracy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import compare_llmcompressor as compare  # noqa: E402


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_the_masks_and_perplexity_agree_with_llm_compressors(method):
    train, held = accuracy.corpus()
    calib, held = accuracy.calibration(train, 16), held[:accuracy.SEQ * 32]
    dense = accuracy.load_model("cpu", torch.float32)
    ours = copy.deepcopy(dense)
    kp.sparsify(ours, method=method, calibration=calib, progress=False)
    theirs, _ = compare.theirs(dense, calib, method)
    a, b = compare.masks(ours), compare.masks(theirs)
    assert sorted(a) == sorted(b) and len(a) == 42
    alike = {name: float((a[name] == b[name]).float().mean()) for name in a}
    mine, other = (kp.evaluate(m, held, seq_len=accuracy.SEQ) for m in (ours, theirs))
    if method == "wanda":  # the same score and the same 2-of-4 choice: the same masks, so the same model
        assert min(alike.values()) == 1.0 and mine == other
    else:  # the same algorithm; float order and the Hessian's dampening differ in detail
        assert sum(alike.values()) / len(alike) > 0.95, alike
        assert abs(mine - other) < 0.01 * other, (mine, other)
