"""Activations and their derivatives as Triton device functions: the math of ``kernelplan.activations``.

Codes are compile-time constants (``ACTIVATION_CODES``), so each kernel
variant carries only the activation it uses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..activations import ACTIVATION_CODES  # noqa: F401  (re-exported for the Triton kernels)


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _normal_cdf(z, F64: tl.constexpr, OUT16: tl.constexpr):
    """Phi(z) = erfc(-z / sqrt 2) / 2.

    fp64 takes libdevice's erf.  fp32 takes erfc(u) = t exp(-u^2 + p(t)),
    t = 1 / (1 + u/2), so Phi keeps its relative accuracy deep in the left
    tail, where 1 + erf cancels to nothing.  p is the degree-9 Chebyshev fit of
    Numerical Recipes (6.2), fractional error < 1.2e-7, for fp32 results; for
    16-bit results (``OUT16``) it is our degree-5 fit of the same function,
    fractional error < 6.4e-5, 1/8 of f16's and 1/60 of bf16's rounding.  Four
    fewer FMAs per element took the bf16 GeGLU forward from 90% to 95% of the
    copy bandwidth on an H200: it is issue-bound, not memory-bound.
    """
    if F64:
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    u = -z * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * tl.abs(u))
    if OUT16:
        p = -1.265576611 + t * (1.004743856 + t * (0.316067287 + t * (
            0.348378325 + t * (-0.591878194 + t * 0.188243911))))
    else:
        p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
            0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * tl.exp(-u * u + p)
    return tl.where(u >= 0, 0.5 * erfc, 1.0 - 0.5 * erfc)


@triton.jit
def act_and_grad(z, ACT: tl.constexpr, GRAD: tl.constexpr, F64: tl.constexpr, OUT16: tl.constexpr):
    """act(z), and act'(z) when GRAD (else a dummy): the math of ``kernelplan.activations``.

    ``F64``: z is fp64 and so is the math; ``OUT16``: the result is rounded to
    f16/bf16, so GELU may take a cheaper Phi (see ``_normal_cdf``).
    """
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
        cdf = _normal_cdf(z, F64, OUT16)
        f = z * cdf
        df = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327 if GRAD else f
    elif ACT == 6:  # quick_gelu, z sigmoid(1.702 z)
        s = _sigmoid(1.702 * z)
        f = z * s
        df = s * (1.0 + 1.702 * z * (1.0 - s))
    else:  # gelu, tanh form: 0.5 (1 + tanh u) = sigmoid(2u), which has no cancellation in the left tail
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        s = _sigmoid(2.0 * u)
        f = z * s
        df = s + 2.0 * z * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * z * z) if GRAD else f
    return f, df
