"""``kernelplan.nn.GatedMLP`` against the same block written in plain torch, in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from kernelplan.errors import InvalidProblem

_ACT = {"glu": torch.sigmoid, "reglu": F.relu, "swiglu": F.silu, "geglu": F.gelu}


def _torch_mlp(mlp: kp.nn.GatedMLP, x):
    h = F.linear(x, mlp.gate_up.weight.to(x.dtype), None if mlp.gate_up.bias is None else mlp.gate_up.bias.to(x.dtype))
    first, second = h.chunk(2, dim=-1)
    act = _ACT[mlp.kind]
    h = act(first) * second if mlp.gate == "first" else first * act(second)
    return F.linear(h, mlp.down.weight.to(x.dtype), None if mlp.down.bias is None else mlp.down.bias.to(x.dtype))


@pytest.mark.parametrize("kind", ["glu", "reglu", "swiglu", "geglu"])
@pytest.mark.parametrize("gate, bias", [("first", False), ("second", True)])
def test_forward_and_backward_match_the_torch_block(kind, gate, bias, seed):
    mlp = kp.nn.GatedMLP(24, 40, kind=kind, gate=gate, bias=bias)
    x = torch.randn(3, 5, 24, requires_grad=True)
    y = mlp(x)
    assert y.shape == (3, 5, 24)
    y.square().sum().backward()
    ours = [x.grad] + [p.grad for p in mlp.parameters()]
    with torch.no_grad():
        oracle_y = _torch_mlp(mlp, x.double())
    x64 = x.detach().double().requires_grad_()
    mlp64 = kp.nn.GatedMLP(24, 40, kind=kind, gate=gate, bias=bias, dtype=torch.float64)
    mlp64.load_state_dict(mlp.state_dict())
    _torch_mlp(mlp64, x64).square().sum().backward()
    xb = x.detach().clone().requires_grad_()
    mlp.zero_grad()
    baseline = _torch_mlp(mlp, xb)
    baseline.square().sum().backward()
    base_grads = [xb.grad] + [p.grad for p in mlp.parameters()]
    assert_close(y, oracle_y, baseline, atol=FWD_ATOL[torch.float32])
    for got, want, base in zip(ours, [x64.grad] + [p.grad for p in mlp64.parameters()], base_grads):
        assert want.norm() > 1e-3
        assert_close(got, want, base, atol=BWD_ATOL[torch.float32], what="grad")


def test_from_projections_is_the_hugging_face_llama_mlp(seed):
    gate, up, down = nn.Linear(16, 48, bias=False), nn.Linear(16, 48, bias=False), nn.Linear(48, 16, bias=False)
    mlp = kp.nn.GatedMLP.from_projections(gate, up, down)
    x = torch.randn(7, 16)
    with torch.no_grad():
        want = down(F.silu(gate(x)) * up(x))
        torch.testing.assert_close(mlp(x), want)
    assert "kind='swiglu', gate='first'" in repr(mlp)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: kp.nn.GatedMLP(0, 8), r"dim is 0; it must be a positive int"),
        (lambda: kp.nn.GatedMLP(8, 8, kind="swish"), r"kind is 'swish'"),
        (lambda: kp.nn.GatedMLP(8, 8, gate="left"), r"gate is 'left'"),
        (lambda: kp.nn.GatedMLP(8, 8, approximate="tanh"), r"only geglu"),
        (lambda: kp.nn.GatedMLP.from_projections(nn.Linear(4, 8), nn.Linear(4, 6), nn.Linear(8, 4)),
         r"gate_proj.weight has shape \(8, 4\) but up_proj.weight has \(6, 4\)"),
        (lambda: kp.nn.GatedMLP.from_projections(nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 8)),
         r"down_proj.weight has shape \(8, 4\); it must be \(4, 8\)"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(InvalidProblem, match=match):
        make()
