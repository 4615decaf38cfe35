"""``FusedLinear`` and ``FusedMLP``: nn.Linear layers whose forward and backward are GEMM epilogues.

Forward runs the ``*_AUX_BIAS`` epilogue: ``act(x @ W^T + b)`` in one GEMM,
which also writes what backward needs (the pre-activation for GELU, the mask
for ReLU).  A lone ``FusedLinear`` with ReLU runs ``RELU_BIAS`` and keeps its
output instead: ``y > 0`` is the mask.  Backward is built from the epilogues of ``kernelplan.gemm``:

* ``dW`` and ``db`` in one GEMM, ``dW = dZ^T @ X`` with ``BGRAD`` summing the
  rows of ``dZ^T`` beside it;
* in ``FusedMLP`` the hidden activation's backward rides on the second
  layer's data-gradient GEMM: ``dZ1 = (dY @ W2) * act'(Z1)`` and ``db1`` are
  that GEMM's ``DGELU_BGRAD`` / ``DRELU_BGRAD`` epilogue, so ``dZ1`` is never
  a separate elementwise pass.  A lone ``FusedLinear`` has no GEMM before its
  activation's backward, so there ``dZ = dY * act'(Z)`` is one elementwise op.

GELU is the tanh approximation (``gelu_tanh``), as cuBLASLt's GELU epilogues.
Every GEMM goes through ``kernelplan.linear``, so it runs on whichever GEMM
backend dispatch picks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .._checks import choice
from ..gemm import linear

ACTIVATIONS_FUSED = ("gelu", "relu")
_AUX_EPILOGUE = {("gelu", True): "gelu_aux_bias", ("gelu", False): "gelu_aux",
                 ("relu", True): "relu_aux_bias", ("relu", False): "relu_aux"}
_GRAD_EPILOGUE = {("gelu", True): "dgelu_bgrad", ("gelu", False): "dgelu",
                  ("relu", True): "drelu_bgrad", ("relu", False): "drelu"}


def _forward_layer(x2, w, b, activation):
    """``(y, aux)`` of one layer; aux is None without an activation."""
    if activation is None:
        return linear(x2, w, b), None
    return linear(x2, w, b, epilogue=_AUX_EPILOGUE[activation, b is not None])


def _weight_grads(dz, x2, has_bias):
    """``dW = dz^T @ x`` and, with a bias, ``db = sum over rows of dz`` from the same GEMM (BGRAD)."""
    if has_bias:
        return linear(dz.t(), x2.t(), epilogue="bgrad")
    return linear(dz.t(), x2.t()), None


def _act_grad(dy, aux, activation):
    """``dy * act'(z)`` from the aux the forward epilogue wrote (bool mask for relu, z for gelu)."""
    # One elementwise kernel each (torch's own GELU backward computes in fp32 for 16-bit dy):
    # the chain of ops of the generic activation table costs more than the GEMMs save.
    if activation == "relu":
        return dy * aux
    return torch.ops.aten.gelu_backward(dy, aux, approximate="tanh")


# Custom ops with autograd formulas (the pattern of every kernelplan op): eager autograd and
# torch.compile(fullgraph=True) take the same path.  The saved tensors leave as extra outputs.

@torch.library.custom_op("kernelplan::fused_linear", mutates_args=())
def _fused_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                     activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, aux)``: aux is what backward reads (empty for relu, whose mask is y > 0, and for no activation)."""
    x2 = x.reshape(-1, x.shape[-1])
    if activation == "relu":
        # relu'(z) is y > 0: the output is the mask, and an aux (a bitmask in cuBLASLt, unpacked
        # into bools) would cost passes over y that backward does not need.
        y, aux = linear(x2, w, b, epilogue="relu_bias" if b is not None else "relu"), None
    else:
        y, aux = _forward_layer(x2, w, b, activation or None)
    return y.reshape(*x.shape[:-1], w.shape[0]), aux if aux is not None else y.new_empty(0)


@_fused_linear_op.register_fake
def _(x, w, b, activation):
    y = x.new_empty((*x.shape[:-1], w.shape[0]))
    return y, x.new_empty((x.shape[:-1].numel(), w.shape[0])) if activation == "gelu" else y.new_empty(0)


def _fused_linear_setup(ctx, inputs, output):
    x, w, b, activation = inputs
    y, aux = output
    ctx.save_for_backward(x, w, y if activation == "relu" else aux)
    ctx.activation, ctx.has_bias = activation or None, b is not None


def _fused_linear_backward(ctx, dy, _daux):
    x, w, aux = ctx.saved_tensors
    x2 = x.reshape(-1, x.shape[-1])
    dz = dy.reshape(-1, w.shape[0])
    if ctx.activation == "relu":
        dz = torch.ops.aten.threshold_backward(dz, aux.reshape(dz.shape), 0)  # aux is y here
    elif ctx.activation is not None:
        dz = _act_grad(dz, aux, ctx.activation)
    need = ctx.needs_input_grad
    dx = linear(dz, w.t()).reshape(x.shape) if need[0] else None
    dw, db = _weight_grads(dz, x2, ctx.has_bias) if need[1] or need[2] else (None, None)
    return dx, dw if need[1] else None, db if need[2] else None, None


_fused_linear_op.register_autograd(_fused_linear_backward, setup_context=_fused_linear_setup)


@torch.library.custom_op("kernelplan::fused_mlp", mutates_args=())
def _fused_mlp_op(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                  b2: Optional[torch.Tensor], activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, aux)``: the hidden activations and the first layer's aux are what backward reads."""
    x2 = x.reshape(-1, x.shape[-1])
    h, aux = _forward_layer(x2, w1, b1, activation)
    y = linear(h, w2, b2)
    return y.reshape(*x.shape[:-1], w2.shape[0]), h, aux


@_fused_mlp_op.register_fake
def _(x, w1, b1, w2, b2, activation):
    rows = x.shape[:-1].numel()
    return (x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((rows, w1.shape[0])),
            x.new_empty((rows, w1.shape[0]), dtype=torch.bool if activation == "relu" else x.dtype))


def _fused_mlp_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, activation = inputs
    _, h, aux = output
    ctx.save_for_backward(x, w1, h, aux, w2)
    ctx.activation, ctx.biases = activation, (b1 is not None, b2 is not None)


def _fused_mlp_backward(ctx, dy, _dh, _daux):
    x, w1, h, aux, w2 = ctx.saved_tensors
    x2 = x.reshape(-1, x.shape[-1])
    has_b1, has_b2 = ctx.biases
    dy2 = dy.reshape(-1, w2.shape[0])
    need = ctx.needs_input_grad
    dw2, db2 = _weight_grads(dy2, h, has_b2)
    # The second layer's data gradient dY @ W2 and the first layer's activation backward
    # (and its bias gradient) in one GEMM.
    grad = linear(dy2, w2.t(), epilogue=_GRAD_EPILOGUE[ctx.activation, has_b1], aux=aux)
    dz1, db1 = grad if has_b1 else (grad, None)
    dw1 = linear(dz1.t(), x2.t()) if need[1] else None
    dx = linear(dz1, w1.t()).reshape(x.shape) if need[0] else None
    return dx, dw1, db1, dw2 if need[3] else None, db2, None


_fused_mlp_op.register_autograd(_fused_mlp_backward, setup_context=_fused_mlp_setup)


def _init_linear(out_features, in_features, bias, factory):
    w = nn.Parameter(torch.empty(out_features, in_features, **factory))
    b = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
    # nn.Linear's initialisation, so the modules drop in for it.
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(b, -bound, bound)
    return w, b


class FusedLinear(nn.Module):
    """``act(x @ W^T + b)`` as one GEMM with a fused epilogue; act is "gelu" (tanh form), "relu" or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = "gelu",
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation = None if activation is None else choice(activation, "activation", ACTIVATIONS_FUSED)
        weight, b = _init_linear(out_features, in_features, bias, dict(device=device, dtype=dtype))
        self.weight = weight
        self.register_parameter("bias", b)  # None without a bias, as nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_linear_op(x, self.weight, self.bias, self.activation or "")[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation}")


class FusedMLP(nn.Module):
    """``fc2(act(fc1(x)))`` whose backward fuses act' and fc1's bias gradient into fc2's dgrad GEMM."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 activation: str = "gelu", bias: bool = True, device=None, dtype=None):
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.activation = choice(activation, "activation", ACTIVATIONS_FUSED)
        factory = dict(device=device, dtype=dtype)
        for i, (fan_out, fan_in) in enumerate(((hidden_features, in_features), (out_features, hidden_features)), 1):
            w, b = _init_linear(fan_out, fan_in, bias, factory)
            self.register_parameter(f"w{i}", w)
            self.register_parameter(f"b{i}", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_mlp_op(x, self.w1, self.b1, self.w2, self.b2, self.activation)[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.w1.shape[1]}, hidden_features={self.w1.shape[0]}, "
                f"out_features={self.w2.shape[0]}, bias={self.b1 is not None}, activation={self.activation}")
