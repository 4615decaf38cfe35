"""Sibling groups and epilogue routes under torch.compile: a settled group traces as one op
(``kernelplan::sparse24_linear_group``, ``sparse24/group.py``) whose members take their columns, a checked gated or
activated route as its fused GEMMs; where they cannot, each layer is its own op, and every result is the layers'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernelplan as kp
from helpers import compiled_graphs
from kernelplan.errors import InvalidProblem
from kernelplan.nn.activated import route_activated_mlps
from kernelplan.nn.gated_siblings import gated_mlp_of
from kernelplan.sparse24 import group
from test_siblings import _pair
from test_sparse24_activated import _linear
from test_sparse24_gated import _llama, _phi3

GROUP, ALONE, AUTOGRAD = "kernelplan.sparse24_linear_group.", "kernelplan.sparse24_linear_inference.", \
    "kernelplan.sparse24_linear."


@pytest.fixture(autouse=True)
def _warn_afresh(monkeypatch):
    """The op's warning is given once a process: each test here sees it afresh."""
    from kernelplan import _checks

    monkeypatch.setattr(_checks, "_WARNED", set())


def _ops(graphs: list[str], op: str) -> int:
    return sum(g.count(op) for g in graphs)


def _settled(seed: int = 0):
    """A sparsified Attention whose q/k/v group an eager pass settled and a second laid out; its unfused copy."""
    torch._dynamo.reset()
    model, alone, siblings = _pair(seed=seed)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(3, 128))
    assert siblings.groups[0].fused is not None
    return model, alone, siblings


@pytest.mark.parametrize("shape", [(3, 128), (2, 5, 128)])
def test_a_settled_group_traces_as_one_op_whose_members_take_their_columns(shape):
    model, alone, siblings = _settled()
    x = torch.randn(shape)
    stats, calls = dict(siblings.stats), dict(group.CALLS)
    with torch.no_grad():
        got, graphs = compiled_graphs(model, x)
        torch.testing.assert_close(got, alone(x), rtol=0, atol=0)
    assert _ops(graphs, GROUP) == 1 and _ops(graphs, ALONE) == 1  # q/k/v's op, then o's
    assert group.CALLS == {"fused": calls["fused"] + 1, "alone": calls["alone"]}  # on the group's buffers
    assert siblings.stats == stats and siblings.groups[0].traced_pass is None


@pytest.mark.parametrize("stage", ["watching", "settled, not laid out", "autograd", "more rows than a group runs"])
def test_each_member_is_its_own_op_where_the_group_cannot_run(stage):
    torch._dynamo.reset()
    model, alone, siblings = _pair()
    x = torch.randn(300 if stage.startswith("more") else 3, 128)
    with torch.no_grad():
        for _ in range({"watching": 0, "settled, not laid out": 1}.get(stage, 2)):
            model(torch.randn(3, 128))
    grad = stage == "autograd"
    with torch.set_grad_enabled(grad):
        got, graphs = compiled_graphs(model, x)
    torch.testing.assert_close(got, alone(x), rtol=1e-6 if grad else 0, atol=1e-6 if grad else 0)
    assert _ops(graphs, GROUP) == 0 and _ops(graphs, AUTOGRAD if grad else ALONE) == 4
    if grad:  # each member's gradient is its own
        got.square().sum().backward()
        alone(x).square().sum().backward()
        torch.testing.assert_close(model.k.values.grad, alone.k.values.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("move", ["load_state_dict(assign=True)", "Module._apply"])
def test_a_compiled_group_whose_members_moved_runs_them_one_by_one_until_laid_out_again(move):
    """New tensors (``load_state_dict(assign=True)``), or new storage under the same Parameters (``Module._apply``, as
    ``.to()`` does), take the members off the group's buffers under the graph's feet: the op sees it and runs each
    member's own GEMM (their new weights, not the buffers' old ones)."""
    model, _, _ = _settled()
    other, _, _ = _pair(seed=1)
    x = torch.randn(4, 128)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        if move.startswith("load"):
            model.load_state_dict(other.state_dict(), assign=True)
        else:
            model._apply(lambda t: t.clone())
            model.load_state_dict(other.state_dict())  # copied into the new storage, not the buffers
        calls = dict(group.CALLS)
        with pytest.warns(RuntimeWarning, match="no longer where the group laid them out"):
            torch.testing.assert_close(compiled(x), other(x), rtol=0, atol=0)
        assert group.CALLS["alone"] == calls["alone"] + 1
        model(x)  # an eager call lays the group out again
        torch.testing.assert_close(compiled(x), other(x), rtol=0, atol=0)
    assert group.CALLS["fused"] == calls["fused"] + 1


def test_members_that_stop_reading_one_input_while_traced_break_the_group():
    model, alone, siblings = _settled()
    x, memory = torch.randn(4, 128), torch.randn(4, 128)
    with torch.no_grad():
        got, graphs = compiled_graphs(model, x, memory)  # k and v read memory: cross-attention
        torch.testing.assert_close(got, alone(x, memory), rtol=0, atol=0)
        assert siblings.groups[0].broken  # as an eager pass would have it
        fused = siblings.stats["fused"]
        torch.testing.assert_close(model(x), alone(x), rtol=0, atol=0)
    assert siblings.stats["fused"] == fused and _ops(graphs, ALONE) == 3


@pytest.mark.parametrize("build", [_llama, _phi3], ids=["llama", "phi3"])
def test_a_checked_gated_mlp_traces_as_its_gated_gemm_and_down_proj(build):
    """Llama's gate/up group, or Phi-3's gate_up layer, with the gated epilogue: two ops, no silu or product."""
    torch._dynamo.reset()
    model = build()
    kp.sparsify(model, progress=False)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        want = type(mlp).forward(mlp, x)
        got, graphs = compiled_graphs(mlp, x)  # not yet checked: the module's own forward
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert _ops(graphs, GROUP) + _ops(graphs, ALONE) == (2 if build is _phi3 else 3)
        for _ in range(2):
            model(torch.randint(0, 100, (1, 4)))  # settled, laid out and checked
        route = gated_mlp_of(mlp)
        assert route.checked
        stats = dict(route.stats)
        torch._dynamo.reset()
        got, graphs = compiled_graphs(mlp, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ops = (0, 2) if build is _phi3 else (1, 1)
    assert (_ops(graphs, GROUP), _ops(graphs, ALONE)) == ops and "gated_silu_first" in graphs[0]
    assert "silu" not in graphs[0].replace("gated_silu_first", "") and route.stats == stats


def test_a_checked_activated_mlp_traces_its_activation_in_the_first_gemm():
    torch._dynamo.reset()
    seq = nn.Sequential(_linear(128, 64, 6), nn.ReLU(), _linear(64, 128, 7)).eval()
    route = route_activated_mlps(seq)[0]
    x = torch.randn(4, 64, dtype=torch.float64)
    with torch.no_grad():
        seq(x)
        assert route.checked
        got, graphs = compiled_graphs(seq, x)
        torch.testing.assert_close(got, nn.Sequential.forward(seq, x))
    assert _ops(graphs, ALONE) == 2 and ", relu, compact)" in graphs[0] and "torch.relu" not in graphs[0]


def test_a_sparsified_llama_compiles_in_one_graph_with_its_groups_and_routes():
    torch._dynamo.reset()
    model = _llama()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            model(ids)
        got, graphs = compiled_graphs(model, ids)
        torch.testing.assert_close(got.logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1 and (_ops(graphs, GROUP), _ops(graphs, ALONE)) == (4, 4)  # a layer: q/k/v, o, gate/up, down


def test_the_group_op_refuses_a_weight_of_no_group_and_its_fake_form_matches_it():
    model, _, siblings = _settled()
    g = siblings.groups[0]
    x = torch.randn(3, 5, 128)
    op = torch.ops.kernelplan.sparse24_linear_group.default
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(48, 128)))
    with pytest.raises(InvalidProblem, match="values is no sibling group's buffer.*kernelplan.sparse24.linear"):
        op(x, w24.values, w24.metadata, None, "", "compact")
    with torch.no_grad():
        want = torch.cat([x.double() @ m.to_dense().double().T + m.bias.double() for m in g.members], -1)
        torch.testing.assert_close(op(x, *g.fused, "", "compact").double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(op(x, *g.fused, "gated_silu_first", "compact").double(),
                                   torch.nn.functional.silu(want[..., :112]) * want[..., 112:], rtol=1e-5, atol=1e-5)
    # The fake form against the real output (torch.library.opcheck runs an op on copies of its inputs, which no group
    # laid out: it cannot check this one).
    from torch._subclasses.fake_tensor import FakeTensorMode

    for epilogue in ("", "gated_silu_first"):
        with torch.no_grad():
            real = op(x, *g.fused, epilogue, "compact")
        with FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), *map(mode.from_tensor, g.fused), epilogue, "compact")
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_on_the_gpu_a_compiled_llama_runs_its_groups_and_gated_gemms_and_matches_the_unfused_model(mode):
    """Inductor's kernels and CUDA graphs around the group op and the gated epilogue: the unfused model's logits at
    three batch sizes, every group call on the group's buffers."""
    torch._dynamo.reset()
    model = _llama().cuda().bfloat16()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 100, (2, 9), device="cuda"))  # settled, laid out and checked
        calls = dict(group.CALLS)
        for shape in [(1, 1), (3, 17), (2, 64), (3, 17)]:
            ids = torch.randint(0, 100, shape, device="cuda")
            for _ in range(3):  # reduce-overhead: warm-up runs, then the graph's replays
                got = compiled(ids).logits.clone()
            want = plain(ids).logits
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()), shape
    assert group.CALLS["alone"] == calls["alone"] and group.CALLS["fused"] > calls["fused"]
