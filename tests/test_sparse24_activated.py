"""MLPs with one activation (``act(dense(x))``, ``fc2(act(fc1(x)))``) on the 2:4 GEMM with the activation in its
epilogue (``nn/activated.py``), found by what a module holds and checked once against its own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernelplan as kp
from helpers import compiled_graphs, compiles_after_warmup
from kernelplan.nn.activated import activated_mlp_of, route_activated_mlps
from kernelplan.nn.gated_siblings import activation_of
from kernelplan.nn.routes import route_of

gpu = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _bert(act="gelu", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=100, hidden_act=act)
    return transformers.BertModel(cfg).eval()


def _neox(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=100)
    return transformers.GPTNeoXForCausalLM(cfg).eval()


def _phi(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.PhiConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=100, pad_token_id=0)
    return transformers.PhiForCausalLM(cfg).eval()


def _clip(seed=0):  # OpenAI CLIP's text tower: fc1, quick GELU, fc2
    torch.manual_seed(seed)
    cfg = transformers.CLIPTextConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=100, max_position_embeddings=64, hidden_act="quick_gelu",
                                      bos_token_id=0, pad_token_id=1, eos_token_id=2)
    return transformers.CLIPTextModel(cfg).eval()


MODELS = {  # the builder, the routed module of its first layer, what the route must find
    "bert": (_bert, lambda m: m.encoder.layer[0].intermediate, ("gelu", "dense", None)),
    "gpt-neox": (_neox, lambda m: m.gpt_neox.layers[0].mlp, ("gelu", "dense_h_to_4h", "dense_4h_to_h")),
    "phi": (_phi, lambda m: m.model.layers[0].mlp, ("gelu_tanh", "fc1", "fc2")),
    "clip": (_clip, lambda m: next(x for x in m.modules() if type(x).__name__ == "CLIPMLP"),  # where it is varies
             ("quick_gelu", "fc1", "fc2")),
}


def _output(model, ids):
    out = model(ids)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("name", MODELS)
def test_hf_mlps_run_their_activation_in_the_epilogue_and_match_the_unfused_model(name):
    build, mlp_of, (act, first, second) = MODELS[name]
    model = build()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    mlp = mlp_of(model)
    route = activated_mlp_of(mlp)
    assert route is not None and route.activation == act and route.first is getattr(mlp, first)
    assert route.second is (getattr(mlp, second) if second else None)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        for _ in range(2):  # the first fused call (checked against the module's own), then fused
            torch.testing.assert_close(_output(model, ids), _output(plain, ids), rtol=1e-5, atol=1e-5)
    assert route.stats == {"own": 0, "fused": 2} and route.checked and route.off is None
    assert set(model.state_dict()) == set(plain.state_dict())
    copied = copy.deepcopy(model)  # the route goes with the module it routes
    assert activated_mlp_of(mlp_of(copied)).mod is mlp_of(copied)
    assert activated_mlp_of(mlp_of(plain)) is None  # fuse=False routes nothing


def _linear(m, k, seed):
    torch.manual_seed(seed)
    return kp.nn.Sparse24Linear.from_dense(nn.Linear(k, m, dtype=torch.float64))


def test_sequential_and_custom_modules_are_routed_by_what_they_hold():
    l1, l2 = _linear(128, 64, 1), _linear(64, 128, 2)
    seq = nn.Sequential(l1, nn.GELU(approximate="tanh"), nn.Dropout(0.1), l2).eval()
    wrong_order = nn.Sequential(nn.ReLU(), _linear(64, 64, 3))
    mish = nn.Sequential(_linear(64, 64, 4), nn.Mish())  # not a kernel's activation

    class Doubled(nn.Module):  # holds a layer and an activation, computes something else
        def __init__(self):
            super().__init__()
            self.dense, self.act = _linear(64, 64, 5), nn.SiLU()

        def forward(self, x):
            return 2 * self.act(self.dense(x))

    doubled = Doubled().eval()
    routes = route_activated_mlps(nn.ModuleList([seq, wrong_order, mish, doubled]))
    assert [type(r.mod) for r in routes] == [nn.Sequential, Doubled] and route_of(wrong_order) is None
    assert route_of(mish) is None and route_activated_mlps(seq) == []  # idempotent
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), l2(torch.nn.functional.gelu(l1(x), approximate="tanh")))
        assert route_of(seq).stats == {"own": 0, "fused": 1}
        with pytest.warns(RuntimeWarning, match="not run with its activation in the GEMM's epilogue"):
            got = doubled(x)
        torch.testing.assert_close(got, 2 * torch.nn.functional.silu(doubled.dense(x)))
        torch.testing.assert_close(doubled(x), got)  # off for good: its own forward, no longer counted
    assert route_of(doubled).off is not None and route_of(doubled).stats == {"own": 1, "fused": 0}


def test_training_mode_autograd_compile_and_other_calls_run_the_modules_own_forward():
    seq = nn.Sequential(_linear(128, 64, 6), nn.ReLU(), nn.Dropout(0.5), _linear(64, 128, 7))
    route = route_activated_mlps(seq)[0]
    x = torch.randn(4, 64, dtype=torch.float64)
    with torch.no_grad():
        seq.train()
        torch.manual_seed(0)
        got = seq(x)  # dropout ran: the route does not see it
        torch.manual_seed(0)
        torch.testing.assert_close(got, nn.Sequential.forward(seq, x))
        seq.eval()
    assert route.stats == {"own": 1, "fused": 0}
    seq(x.requires_grad_()).sum().backward()  # autograd: each layer its own op
    assert route.stats == {"own": 2, "fused": 0} and seq[0].values.grad is not None
    with torch.no_grad():
        got, graphs = compiled_graphs(seq, x.detach())
    torch.testing.assert_close(got, nn.Sequential.forward(seq, x.detach()))
    assert sum(g.count("kernelplan.sparse24_linear") for g in graphs) == 2 and route.stats["fused"] == 0


def test_a_child_replaced_after_a_checked_fused_call_runs_the_modules_own_forward_until_it_is_back():
    """The fused GEMMs read the layers the route was built on: after a swap they would compute the old function."""
    first, second = _linear(128, 64, 8), _linear(64, 128, 9)
    seq = nn.Sequential(first, nn.ReLU(), second).eval()
    route = route_activated_mlps(seq)[0]
    x = torch.randn(3, 64, dtype=torch.float64)
    with torch.no_grad():
        seq(x)
        assert route.checked and route.stats == {"own": 0, "fused": 1}
        seq[2] = other = _linear(64, 128, 10)
        torch.testing.assert_close(seq(x), other(torch.relu(first(x))))
        assert route.stats == {"own": 1, "fused": 1}
        seq[2] = second
        torch.testing.assert_close(seq(x), second(torch.relu(first(x))))
    assert route.stats == {"own": 1, "fused": 2} and route.off is None


def test_the_activation_probe_runs_no_hooks():
    act = nn.GELU()
    seen = []
    act.register_forward_hook(lambda *a: seen.append(1))
    assert activation_of(act) == "gelu" and seen == []
    assert activation_of(transformers.activations.QuickGELUActivation()) == "quick_gelu"
    assert activation_of(nn.Mish()) is None


def test_warmup_lists_the_activated_gemms():
    from kernelplan.warm import table

    model = _bert()
    kp.sparsify(model, progress=False)
    rows = kp.warmup(model, batch_sizes=(1, 8), progress=False)
    activated = [(r["m"], r["k"], r["n"], r["epilogue"]) for r in rows if r.get("epilogue")]
    assert activated == [(256, 64, 1, "gelu"), (256, 64, 8, "gelu")]
    assert "(gelu)" in table(rows)


# -- on the GPU ---------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("name", MODELS)
def test_hf_activated_mlps_on_the_gpu_eager_and_in_a_graph(name):
    """In bf16 on the GPU: the unfused model's outputs, eagerly and replayed from a CUDA graph captured after the
    epilogue's GEMM ran once; the weights held once."""
    from kernelplan.bench.decode import Graphed, weight_bytes

    build, mlp_of, _ = MODELS[name]
    model = build().cuda().bfloat16()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    ids = torch.randint(0, 100, (2, 33), device="cuda")
    route = activated_mlp_of(mlp_of(model))
    with torch.no_grad():
        for _ in range(2):
            got, want = _output(model, ids), _output(plain, ids)
        assert route.stats == {"own": 0, "fused": 2} and route.checked
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
        assert weight_bytes(model) == weight_bytes(plain)
        # torch makes its cuBLAS handle on first use, which fails inside a capture (CUBLAS_STATUS_NOT_INITIALIZED);
        # every linear layer here is 2:4, and the eager attention used no cuBLAS call, the captured one does.
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        graphed = Graphed(lambda: _output(model, ids), warmup=1)
        graphed.graph.replay()
        # Within rounding of the eager result, not equal: the captured attention took another backend (its matmuls).
        assert float((graphed.out - want).abs().max()) <= 0.02 * float(want.abs().max())
    assert route.stats["fused"] == 4  # the capture ran the fused GEMM


@gpu
def test_on_the_gpu_warmup_builds_the_activated_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    model = _bert().cuda().bfloat16()
    kp.sparsify(model, progress=False)
    assert compiles_after_warmup(model) == 0
    assert activated_mlp_of(model.encoder.layer[0].intermediate).stats["fused"] == 3
