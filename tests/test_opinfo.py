"""Every op against its fp64 oracle: samples forward and backward, gradcheck, error inputs."""

from __future__ import annotations

import pytest
import torch

from helpers import BWD_ATOL, FWD_ATOL, assert_close
from kernelplan.sparse24 import Sparse24Weight
from opinfo import OPS



def _cast(obj, dtype, requires_grad=False):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        t = obj.detach().to(dtype)
        return t.requires_grad_(requires_grad)
    if isinstance(obj, Sparse24Weight):
        values = obj.values.detach().to(dtype).requires_grad_(requires_grad)
        return Sparse24Weight(values, obj.metadata)
    return obj


def _cast_sample(sample, dtype, grad_positions=()):
    args = tuple(_cast(a, dtype, i in grad_positions) for i, a in enumerate(sample.args))
    kwargs = {k: _cast(v, dtype, k == "bias" and "bias" in grad_positions) for k, v in sample.kwargs.items()}
    return args, kwargs


def _leaves(args, kwargs):
    """The tensors gradients flow to, by name, for comparison."""
    out = {}
    for i, a in enumerate(args):
        t = a.values if isinstance(a, Sparse24Weight) else a
        if isinstance(t, torch.Tensor) and t.requires_grad:
            out[f"arg{i}"] = t
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            out[k] = v
    return out


def _cases():
    for op in OPS:
        for dtype in op.dtypes:
            torch.manual_seed(0)
            for sample in op.samples("cpu", dtype):
                yield pytest.param(op, sample, dtype, id=f"{op.name}-{str(dtype)[6:]}-{sample.desc}")


@pytest.mark.parametrize("op, sample, dtype", list(_cases()))
def test_forward_matches_fp64_oracle(op, sample, dtype):
    out = op.op(*sample.args, **sample.kwargs)
    args64, kwargs64 = _cast_sample(sample, torch.float64)
    oracle = op.reference(*args64, **kwargs64)
    baseline = op.reference(*sample.args, **sample.kwargs)
    assert_close(out, oracle, baseline, atol=FWD_ATOL[dtype])


@pytest.mark.parametrize("op, sample, dtype", list(_cases()))
def test_backward_matches_fp64_oracle(op, sample, dtype):
    positions = set(op.differentiable) | {"bias"}
    args, kwargs = _cast_sample(sample, dtype, positions)
    if isinstance(args[1], Sparse24Weight):
        args[1].values.requires_grad_(True)
    out = op.op(*args, **kwargs)
    if out.numel() == 0:
        pytest.skip("empty output: nothing flows back")
    dy = torch.randn_like(out, dtype=torch.float32)
    out.backward(dy.to(out.dtype))

    args64, kwargs64 = _cast_sample(sample, torch.float64, positions)
    if isinstance(args64[1], Sparse24Weight):
        args64[1].values.requires_grad_(True)
    op.reference(*args64, **kwargs64).backward(dy.double())
    argsb, kwargsb = _cast_sample(sample, dtype, positions)
    if isinstance(argsb[1], Sparse24Weight):
        argsb[1].values.requires_grad_(True)
    op.reference(*argsb, **kwargsb).backward(dy.to(dtype))

    ours, oracle, base = _leaves(args, kwargs), _leaves(args64, kwargs64), _leaves(argsb, kwargsb)
    assert ours.keys() == oracle.keys() and ours, "no gradients to compare"
    for name in ours:
        g = ours[name].grad
        assert g is not None, f"no gradient reached {name}"
        # A gradient that is ~0 would pass any tolerance: make sure this one can fail.
        assert oracle[name].grad.norm() > 1e-3, f"oracle gradient of {name} is trivially small"
        assert_close(g, oracle[name].grad, base[name].grad, atol=BWD_ATOL[dtype], what=f"grad {name}")


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_gradcheck_fp64(op):
    torch.manual_seed(1)
    for sample in op.samples("cpu", torch.float64)[:4]:
        args, kwargs = _cast_sample(sample, torch.float64)
        if any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args):
            continue
        inputs, rebuild = _gradcheck_inputs(args, kwargs, op.differentiable)
        assert torch.autograd.gradcheck(lambda *ts: op.op(*rebuild(ts)[0], **rebuild(ts)[1]), inputs), sample.desc


def _gradcheck_inputs(args, kwargs, positions):
    tensors, slots = [], []
    for i, a in enumerate(args):
        if isinstance(a, Sparse24Weight):
            tensors.append(a.values.detach().requires_grad_(True)); slots.append(("w24", i, a.metadata))
        elif isinstance(a, torch.Tensor) and i in positions:
            tensors.append(a.detach().requires_grad_(True)); slots.append(("arg", i, None))
    if isinstance(kwargs.get("bias"), torch.Tensor):
        tensors.append(kwargs["bias"].detach().requires_grad_(True)); slots.append(("bias", None, None))

    def rebuild(ts):
        a, kw = list(args), dict(kwargs)
        for t, (kind, i, meta) in zip(ts, slots):
            if kind == "w24":
                a[i] = Sparse24Weight(t, meta)
            elif kind == "arg":
                a[i] = t
            else:
                kw["bias"] = t
        return tuple(a), kw

    return tuple(tensors), rebuild


def _error_cases():
    for op in OPS:
        for err in op.errors("cpu"):
            yield pytest.param(err, id=f"{op.name}-{err.desc}")


@pytest.mark.parametrize("err", list(_error_cases()))
def test_error_inputs(err):
    with pytest.raises(err.exc, match=err.match):
        err.call()
