"""GEMM epilogues and fp8 scale sets (seed: atomr-accel-cuda ``MatmulRequest``).

A GEMM computes ``Z = alpha * op(A) @ op(B) + beta * C``, ``D[m, n]`` row-major,
then its epilogue:

=================  ============================================================
NONE               ``D = Z``
BIAS               ``D = Z + bias[n]`` (one bias per output feature: nn.Linear)
RELU / GELU        ``D = act(Z)``; with _BIAS: ``D = act(Z + bias)``
*_AUX              as above, and also writes ``aux``: for GELU the pre-activation
                   (``Z + bias``) in D's dtype, for RELU the bool mask ``Z + bias > 0``
DRELU / DGELU      ``D = Z * act'(aux)``, ``aux`` read as written by the _AUX
                   forward: the gradient through the previous layer's activation
D*_BGRAD           as above, and ``bgrad[n] = sum_m D[m, n]``: that layer's bias grad
BGRAD              ``D = Z``, and ``bgrad[m] = sum_k op(A)[m, k]``: with
                   ``op(A) = dY^T`` this is the bias gradient beside ``dW = dY^T X``
=================  ============================================================

GELU here is the tanh approximation, as in cuBLASLt.  With fp8 inputs,
``op(A)`` and ``op(B)`` are first multiplied by their dequantisation scales;
``amax`` receives ``max |D|`` before the output scale; an fp8 ``D`` is
``saturate(D * scale_out)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..errors import InvalidProblem


class Epilogue(str, enum.Enum):
    NONE = "none"
    BIAS = "bias"
    RELU = "relu"
    RELU_BIAS = "relu_bias"
    GELU = "gelu"
    GELU_BIAS = "gelu_bias"
    RELU_AUX = "relu_aux"
    RELU_AUX_BIAS = "relu_aux_bias"
    GELU_AUX = "gelu_aux"
    GELU_AUX_BIAS = "gelu_aux_bias"
    DRELU = "drelu"
    DRELU_BGRAD = "drelu_bgrad"
    DGELU = "dgelu"
    DGELU_BGRAD = "dgelu_bgrad"
    BGRAD = "bgrad"

    @classmethod
    def parse(cls, value) -> "Epilogue":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidProblem(
                f"epilogue is {value!r}; it must be a kernelplan.Epilogue or one of "
                f"{', '.join(repr(e.value) for e in cls)}"
            ) from None

    @property
    def spec(self) -> "EpilogueSpec":
        return _SPECS[self]


@dataclass(frozen=True)
class EpilogueSpec:
    bias: bool = False  # adds bias[n] before the activation
    activation: str = "identity"  # applied last: identity | relu | gelu_tanh
    aux_out: bool = False  # writes aux for the backward pass
    aux_in: str | None = None  # multiplies Z by act'(aux): relu | gelu_tanh
    bgrad: str | None = None  # "d": column sums of D -> [n]; "a": row sums of op(A) -> [m]

    @property
    def aux_activation(self) -> str | None:
        """The activation whose aux is written or read, if any."""
        return self.aux_in or (self.activation if self.aux_out else None)


_SPECS = {
    Epilogue.NONE: EpilogueSpec(),
    Epilogue.BIAS: EpilogueSpec(bias=True),
    Epilogue.RELU: EpilogueSpec(activation="relu"),
    Epilogue.RELU_BIAS: EpilogueSpec(bias=True, activation="relu"),
    Epilogue.GELU: EpilogueSpec(activation="gelu_tanh"),
    Epilogue.GELU_BIAS: EpilogueSpec(bias=True, activation="gelu_tanh"),
    Epilogue.RELU_AUX: EpilogueSpec(activation="relu", aux_out=True),
    Epilogue.RELU_AUX_BIAS: EpilogueSpec(bias=True, activation="relu", aux_out=True),
    Epilogue.GELU_AUX: EpilogueSpec(activation="gelu_tanh", aux_out=True),
    Epilogue.GELU_AUX_BIAS: EpilogueSpec(bias=True, activation="gelu_tanh", aux_out=True),
    Epilogue.DRELU: EpilogueSpec(aux_in="relu"),
    Epilogue.DRELU_BGRAD: EpilogueSpec(aux_in="relu", bgrad="d"),
    Epilogue.DGELU: EpilogueSpec(aux_in="gelu_tanh"),
    Epilogue.DGELU_BGRAD: EpilogueSpec(aux_in="gelu_tanh", bgrad="d"),
    Epilogue.BGRAD: EpilogueSpec(bgrad="a"),
}


@dataclass(frozen=True)
class ScaleSet:
    """fp8 scales.  Each scale is a float, a 1-element tensor, or a vector.

    * ``a``: dequantisation scale of ``op(A)``: scalar, or ``[m]`` (one per row);
    * ``b``: dequantisation scale of ``op(B)``: scalar, or ``[n]`` (one per column,
      i.e. per output feature in nn.Linear terms);
    * ``out``: quantisation scale applied to D before the cast to an fp8 D;
    * ``amax``: a float32 tensor of one element that receives ``max |D|``
      (before ``out``), as used by delayed-scaling recipes.
    """

    a: torch.Tensor | float | None = None
    b: torch.Tensor | float | None = None
    out: torch.Tensor | float | None = None
    amax: torch.Tensor | None = None

    def mode(self, which: str, length: int) -> str:
        """"none", "tensor" or "vector" for scale ``which`` of a dim of ``length``."""
        s = getattr(self, which)
        if s is None:
            return "none"
        if isinstance(s, (int, float)):
            return "tensor"
        if isinstance(s, torch.Tensor) and s.dim() <= 1 and s.numel() == 1:
            return "tensor"  # a length-1 vector means the same as a scalar
        if isinstance(s, torch.Tensor) and s.dim() == 1 and s.shape[0] == length:
            return "vector"
        shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
        raise InvalidProblem(
            f"scales.{which} has shape {shape}; it must be a scalar (float or 1-element tensor) "
            f"or a vector of length {length} (one scale per {'row of op(A)' if which == 'a' else 'column of D'})"
        )
