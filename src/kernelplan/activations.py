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
ACTIVATION_CODES = {"sigmoid": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4, "identity": 5}

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
    )
}
