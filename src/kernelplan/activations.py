"""Pointwise activations and their derivatives, as one table used by every op.

Math runs in the dtype given (callers pass fp32, or fp64 for fp64 inputs).
"gelu" is the exact erf form, "gelu_tanh" the tanh approximation
(``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``, as in cuBLASLt).  Both are
written so that they keep relative accuracy in the left tail (erfc, sigmoid),
where the textbook ``1 + erf`` and ``1 + tanh`` cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# The ``ACT`` compile-time code of every GPU kernel (Triton and CUDA C++), by name.  Here, not
# beside the Triton device functions, so that the CUDA C++ kernels need no Triton to compile.
ACTIVATION_CODES = {"sigmoid": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4, "identity": 5, "quick_gelu": 6}
# quick_gelu is z * sigmoid(1.702 z), OpenAI CLIP's GELU (Hugging Face's QuickGELUActivation).
_QUICK = 1.702

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_erf(z):
    return z * _phi_cdf(z)


def _gelu_erf_grad(z):
    return _phi_cdf(z) + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI


def _phi_cdf(z):
    # erfc rather than 1 + erf: the latter cancels to nothing in the left tail.
    return 0.5 * torch.special.erfc(-z * _INV_SQRT_2)


def _gelu_tanh(z):
    # 0.5 (1 + tanh u) == sigmoid(2u), which keeps its relative accuracy in the left tail.
    return z * torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z))


def _gelu_tanh_grad(z):
    s = torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (z + 0.044715 * z * z * z))
    return s + 2.0 * z * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)


def _silu_grad(z):
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def _quick_gelu_grad(z):
    s = torch.sigmoid(_QUICK * z)
    return s * (1.0 + _QUICK * z * (1.0 - s))


def _sigmoid_grad(z):
    s = torch.sigmoid(z)
    return s * (1.0 - s)


@dataclass(frozen=True)
class Activation:
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor], torch.Tensor]  # d fn / dz, evaluated at z


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("identity", lambda z: z, torch.ones_like),
        Activation("relu", torch.relu, lambda z: (z > 0).to(z.dtype)),
        Activation("gelu", _gelu_erf, _gelu_erf_grad),
        Activation("gelu_tanh", _gelu_tanh, _gelu_tanh_grad),
        Activation("silu", lambda z: z * torch.sigmoid(z), _silu_grad),
        Activation("sigmoid", torch.sigmoid, _sigmoid_grad),
        Activation("quick_gelu", lambda z: z * torch.sigmoid(_QUICK * z), _quick_gelu_grad),
    )
}


# Gated epilogues of a GEMM whose weight's rows are two halves [first; second] of M / 2 each: column c of the
# output is act(gate) * other, of rows c and M / 2 + c, the gate being the half ``gate`` names (as
# kernelplan.gated_activation's gate= does for the halves of its input).  One name per activation and half, the
# form a plan's descriptor and a kernel variant take; ``GATED_CODES`` is the kernels' compile-time GATED.
GATED_GATES = ("first", "second")
GATED_CODES = {"first": 1, "second": 2}


@dataclass(frozen=True)
class GatedEpilogue:
    name: str
    act: str  # an ACTIVATIONS name, applied to the gate half
    gate: str  # "first" or "second"

    def halves(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, other) of the pre-activation z [..., M]."""
        first, second = z.chunk(2, dim=-1)
        return (first, second) if self.gate == "first" else (second, first)

    def fn(self, z: torch.Tensor) -> torch.Tensor:
        gate, other = self.halves(z)
        return ACTIVATIONS[self.act].fn(gate) * other

    def grad(self, z: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """dL/dz [..., M] from dL/dy [..., M / 2]."""
        gate, other = self.halves(z)
        act = ACTIVATIONS[self.act]
        d_gate, d_other = dy * other * act.grad(gate), dy * act.fn(gate)
        return torch.cat((d_gate, d_other) if self.gate == "first" else (d_other, d_gate), dim=-1)


GATED_EPILOGUES: dict[str, GatedEpilogue] = {
    f"gated_{act}_{gate}": GatedEpilogue(f"gated_{act}_{gate}", act, gate)
    for act in ("sigmoid", "relu", "silu", "gelu", "gelu_tanh") for gate in GATED_GATES
}


def epilogue_columns(m: int, epilogue: str | None) -> int:
    """Columns of a GEMM's output whose weight has ``m`` rows, under ``epilogue`` (an activation, a gated epilogue
    or None)."""
    return m // 2 if epilogue in GATED_EPILOGUES else m


def kernel_epilogue(epilogue: str | None) -> tuple[str, int]:
    """``(ACTIVATION_CODES name, GATED code)`` of an epilogue, for the kernels' compile-time ACT and GATED."""
    gated = GATED_EPILOGUES.get(epilogue)
    if gated is not None:
        return gated.act, GATED_CODES[gated.gate]
    return epilogue or "identity", 0
