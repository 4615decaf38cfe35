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
