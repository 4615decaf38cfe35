"""A transformers Llama, sparsified: logits match the masked-dense model and generate() runs.

Skipped where transformers is not installed (the CPU CI machine); it is on the GPU machines.
"""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_sparsified_llama_matches_masked_dense_and_generates(seed):
    model = _tiny_llama()
    dense = _tiny_llama()
    dense.load_state_dict(model.state_dict())
    report = kp.sparsify(model, progress=False)
    # q/k/v/o, gate/up/down in 2 layers, and lm_head: every projection has in_features % 8 == 0.
    assert len(report.converted) == 2 * 7 + 1 and not report.skipped
    with torch.no_grad():
        for name in report.converted:
            dense.get_submodule(name).weight.copy_(model.get_submodule(name).to_dense())
        ids = torch.randint(0, 128, (2, 12))
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
        out = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)
    assert torch.equal(out, dense.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0))
