"""Activations and their derivatives as Triton device functions: the math of ``kernelplan.activations``.

Codes are compile-time constants (``ACTIVATION_CODES``), so each kernel
variant carries only the activation it uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The ``ACT`` constexpr of every kernel, by ``kernelplan.activations`` name.
ACTIVATION_CODES = {"sigmoid": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4, "identity": 5}


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _normal_cdf(z, F64: tl.constexpr):
    """Phi(z) = erfc(-z / sqrt 2) / 2.

    fp64 takes libdevice's erf.  fp32 takes the Chebyshev erfc of Numerical
    Recipes (6.2), fractional error < 1.2e-7 everywhere, so Phi keeps its
    relative accuracy deep in the left tail; it is one exp and nine FMAs where
    libdevice's erff costs about twice that, which left the bf16 GeGLU
    compute-bound below the copy bandwidth.
    """
    if F64:
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    u = -z * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * tl.abs(u))
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * tl.exp(-u * u + p)
    return tl.where(u >= 0, 0.5 * erfc, 1.0 - 0.5 * erfc)


@triton.jit
def act_and_grad(z, ACT: tl.constexpr, GRAD: tl.constexpr, F64: tl.constexpr):
    """act(z), and act'(z) when GRAD (else a dummy): the math of ``kernelplan.activations``."""
    if ACT == 5:  # identity
        f = z
        df = z * 0.0 + 1.0
    elif ACT == 0:  # sigmoid
        f = _sigmoid(z)
        df = f * (1.0 - f)
    elif ACT == 1:  # relu
        f = tl.where(z > 0, z, 0.0)
        df = tl.where(z > 0, 1.0, 0.0)
    elif ACT == 2:  # silu
        s = _sigmoid(z)
        f = z * s
        df = s * (1.0 + z * (1.0 - s))
    elif ACT == 3:  # gelu, erf form
        cdf = _normal_cdf(z, F64)
        f = z * cdf
        df = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327 if GRAD else f
    else:  # gelu, tanh form: 0.5 (1 + tanh u) = sigmoid(2u), which has no cancellation in the left tail
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        s = _sigmoid(2.0 * u)
        f = z * s
        df = s + 2.0 * z * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * z * z) if GRAD else f
    return f, df
