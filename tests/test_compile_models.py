"""``torch.compile`` over sparsified models of the families the README names, one of each modelling code: one graph
(``fullgraph=True``), every 2:4 layer one op of it, and the unfused model's outputs, after eager passes settled the
model's sibling groups and checked its epilogue routes (which step aside while traced: docs/design/0076)."""

from __future__ import annotations

import copy

import pytest
import torch

import kernelplan as kp
from helpers import compiled_graphs
from kernelplan.nn import Sparse24Linear

transformers = pytest.importorskip("transformers")

_SMALL = dict(num_hidden_layers=1, num_attention_heads=4, vocab_size=100)  # a layer: tracing is CI's time
_DECODERS = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, **_SMALL)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_DECODERS),  # and Mistral's modules (0077)
    "qwen2": lambda: transformers.Qwen2Config(**_DECODERS),  # q/k/v with biases: a group with a bias buffer
    "gemma2": lambda: transformers.Gemma2Config(head_dim=32, **_DECODERS),
    "phi3": lambda: transformers.Phi3Config(pad_token_id=0, **_DECODERS),
    "phi": lambda: transformers.PhiConfig(hidden_size=128, intermediate_size=512, **_SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=512, **_SMALL),
    "falcon": lambda: transformers.FalconConfig(hidden_size=128, new_decoder_architecture=False, **_SMALL),
    "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=1, n_head=4, vocab_size=100, bos_token_id=0,
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
    assert len(graphs) == 1 and layers >= 4 and ops == layers


def test_a_sparsified_t5_runs_compiles_and_round_trips_as_the_unfused_model(tmp_path):
    """T5 reads ``wo.weight.dtype`` in its feed-forward (Sparse24Linear.weight, sparse24/dense_view.py) and ties its
    stacks' embeddings to ``shared`` (a checkpoint holds them once: kp.hf.load_model)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=128, d_kv=32, d_ff=256, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    plain = copy.deepcopy(model)
    report = kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    args = (torch.randint(0, 100, (2, 9)),)
    kwargs = {"decoder_input_ids": torch.randint(0, 100, (2, 5))}
    with torch.no_grad():
        want = plain(*args, **kwargs).logits
        for _ in range(2):
            torch.testing.assert_close(model(*args, **kwargs).logits, want, rtol=0, atol=0)
        got, graphs = compiled_graphs(model, *args, **kwargs)
        torch.testing.assert_close(got.logits, want, rtol=0, atol=0)
        kp.hf.save_model(model, tmp_path / "t5")
        loaded = kp.hf.load_model(tmp_path / "t5")
        torch.testing.assert_close(loaded(*args, **kwargs).logits, want, rtol=0, atol=0)
    assert len(report.converted) == 16 and len(graphs) == 1 and type(loaded) is type(model)


@pytest.mark.parametrize("strict", [False, True])
def test_a_sparsified_llama_exports_with_each_2_4_layer_one_op_and_matches_the_unfused_model(strict):
    """``torch.export`` (dynamo's trace, or the non-strict one), after eager passes settled the groups and checked
    the routes: they step aside in the export as under compile, and each 2:4 layer is one op of the graph."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"]()).eval()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)

    class Logits(torch.nn.Module):  # no cache: export's outputs must be tensors
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids, use_cache=False).logits

    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            model(ids)
        program = torch.export.export(Logits(model), (ids,), strict=strict)
        torch.testing.assert_close(program.module()(ids), Logits(plain)(ids), rtol=0, atol=0)
    ops = [n for n in program.graph.nodes if n.op == "call_function" and "sparse24_linear" in str(n.target)]
    assert len(ops) == sum(isinstance(m, Sparse24Linear) for m in model.modules()) == 7
