"""``torch.compile`` over sparsified models of each family the README names: one graph (``fullgraph=True``), every
2:4 layer one op of it, and the unfused model's outputs, after eager passes settled the model's sibling groups and
checked its epilogue routes (which step aside while traced: docs/design/0076)."""

from __future__ import annotations

import copy

import pytest
import torch

import kernelplan as kp
from helpers import compiled_graphs
from kernelplan.nn import Sparse24Linear

transformers = pytest.importorskip("transformers")

_SMALL = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
_DECODERS = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, **_SMALL)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_DECODERS),
    "qwen2": lambda: transformers.Qwen2Config(**_DECODERS),
    "mistral": lambda: transformers.MistralConfig(**_DECODERS),
    "gemma2": lambda: transformers.Gemma2Config(head_dim=32, **_DECODERS),
    "phi3": lambda: transformers.Phi3Config(pad_token_id=0, **_DECODERS),
    "phi": lambda: transformers.PhiConfig(hidden_size=128, intermediate_size=512, **_SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=512, **_SMALL),
    "falcon": lambda: transformers.FalconConfig(hidden_size=128, new_decoder_architecture=False, **_SMALL),
    "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0,
                                            eos_token_id=0),
    "bert": lambda: transformers.BertConfig(hidden_size=128, intermediate_size=512, **_SMALL),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sparsified_model_compiles_in_one_graph_of_its_2_4_ops_and_matches_the_unfused_model(family):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    build = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
    model = build.from_config(cfg).eval()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    layers = sum(isinstance(m, Sparse24Linear) for m in model.modules())
    ids = torch.randint(0, 100, (2, 9))
    key = "last_hidden_state" if family == "bert" else "logits"
    with torch.no_grad():
        for _ in range(2):
            model(ids)  # the groups settle, are laid out, and the routes are checked
        got, graphs = compiled_graphs(model, ids)
        torch.testing.assert_close(got[key], plain(ids)[key], rtol=0, atol=0)
    ops = sum(g.count("kernelplan.sparse24_linear_inference.") for g in graphs)
    assert len(graphs) == 1 and layers >= 8 and ops == layers
