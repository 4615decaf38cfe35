"""The custom ops trace under torch.compile(fullgraph=True), forward and backward."""

from __future__ import annotations

import torch

import kernelplan as kp


def test_sparse24_linear_and_gated_activation_compile_fullgraph():
    torch._dynamo.reset()
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    bias = torch.randn(32, requires_grad=True)
    w24.values.requires_grad_(True)

    def block(x):
        h = kp.sparse24.linear(x, w24, bias, activation="silu")
        return kp.gated_activation(h, "swiglu", dim=-1, gate="first")

    # aot_eager traces through the fake and autograd registrations without a C++ toolchain.
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = compiled(x)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (x, bias, w24.values)]
    for t in (x, bias, w24.values):
        t.grad = None
    block(x).square().sum().backward()
    for got, want in zip(grads, (x.grad, bias.grad, w24.values.grad)):
        assert want.norm() > 0
        torch.testing.assert_close(got, want)


def test_gated_out_forms_compile_fullgraph():
    """The out= ops mutate their last argument; torch.compile functionalises them."""
    torch._dynamo.reset()

    def step(x, y, dy, dx):
        kp.gated_activation(x, "geglu", dim=0, gate="first", out=y)
        kp.gated_activation_backward(dy, x, "geglu", dim=0, gate="first", out=dx)
        return y.sum() + dx.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, dy = torch.randn(8, 5), torch.randn(4, 5)
    y, dx = torch.full((4, 5), float("nan")), torch.full((8, 5), float("nan"))
    total = compiled(x, y, dy, dx)
    want_y = kp.gated_activation(x, "geglu", dim=0, gate="first")
    want_dx = kp.gated_activation_backward(dy, x, "geglu", dim=0, gate="first")
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(total, want_y.sum() + want_dx.sum())


def test_sparse24_inference_skips_the_op_in_eager_but_not_under_compile():
    """Plain eager inference calls the implementation directly; compile still sees the custom op."""
    from unittest import mock

    from kernelplan.sparse24 import gemm

    torch._dynamo.reset()
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    x = torch.randn(3, 64)
    with mock.patch.object(gemm, "_sparse24_linear_op", wraps=gemm._sparse24_linear_op) as op:
        eager = kp.sparse24.linear(x, w24, activation="relu")
        assert op.call_count == 0
        xg = x.clone().requires_grad_()
        kp.sparse24.linear(xg, w24, activation="relu").sum().backward()
        assert op.call_count == 1 and xg.grad is not None  # autograd takes the op
    # Under compile the traced graph holds the custom op (fullgraph would fail on the raw kernels).
    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    compiled = torch.compile(lambda t: kp.sparse24.linear(t, w24, activation="relu"), fullgraph=True, backend=backend)(x)
    assert any("kernelplan.sparse24_linear" in g for g in graphs)
    torch.testing.assert_close(eager, compiled)
    torch.testing.assert_close(eager, torch.relu(x @ w24.decompress().T))


def test_gated_inference_skips_the_op_in_eager_and_compile_keeps_it():
    from unittest import mock

    from kernelplan import gated

    torch._dynamo.reset()
    x = torch.randn(4, 10)
    with mock.patch.object(gated, "_gated_op", wraps=gated._gated_op) as op:
        eager = kp.gated_activation(x, "geglu", gate="first")
        assert op.call_count == 0
        kp.gated_activation(x.clone().requires_grad_(), "geglu", gate="first").sum().backward()
        assert op.call_count == 1
    graphs = []

    def backend(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    compiled = torch.compile(lambda t: kp.gated_activation(t, "geglu", gate="first"), fullgraph=True, backend=backend)(x)
    assert any("kernelplan.gated_activation" in g for g in graphs)
    torch.testing.assert_close(eager, compiled)


def test_model_holding_sparse24_linear_compiles_fullgraph_and_trains():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    kp.sparsify(model, progress=False)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 64)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        assert want.norm() > 0
        torch.testing.assert_close(got, want)
