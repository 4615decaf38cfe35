"""fp8 quantisation and the fp8 linear built on ``kernelplan.linear``.

``quantize(x, recipe)`` scales ``x`` into the fp8 range and returns the fp8
data with its *dequantisation* scale (``x ≈ data * scale``) and ``amax``:

* ``"tensor"``: one scale for the whole tensor;
* ``"rowwise"``: one scale per row of ``x.reshape(-1, x.shape[-1])``, as
  ``torch._scaled_mm``'s rowwise mode takes them.

``scale = amax / fp8_max``, so the largest magnitude lands on the format's
largest finite value; an all-zero row gets scale 1.  ``linear(xq, wq, bias)``
multiplies two quantized operands (nn.Linear layout for ``wq``) with fp32
accumulation and returns ``out_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_has_data, check_tensor, choice
from .dtypes import FLOAT_DTYPES, FP8_DTYPES, dtype_info
from .errors import InvalidProblem
from .gemm import ScaleSet
from .gemm import linear as _linear

RECIPES = ("tensor", "rowwise")


@dataclass(frozen=True)
class Quantized:
    data: torch.Tensor  # fp8, x's shape
    scale: torch.Tensor  # fp32: [] ("tensor") or x.shape[:-1] ("rowwise"); x ≈ data * scale
    amax: torch.Tensor  # fp32, the same shape as scale
    recipe: str

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale if self.recipe == "tensor" else self.scale.unsqueeze(-1)
        return (self.data.to(torch.float32) * scale).to(dtype)


def quantize(x: torch.Tensor, recipe: str = "tensor", dtype: torch.dtype = torch.float8_e4m3fn) -> Quantized:
    """Scale ``x`` into fp8 (e4m3 by default, or e5m2): data, dequantisation scale and amax."""
    check_tensor(x, "x")
    check_has_data(x, "x", "quantize")
    dtype_info(x.dtype, "x", FLOAT_DTYPES)
    recipe = choice(recipe, "recipe", RECIPES)
    info = dtype_info(dtype, "dtype", FP8_DTYPES)
    if recipe == "rowwise" and x.dim() < 1:
        raise InvalidProblem("x is 0-d; rowwise quantisation needs rows: pass x with rank >= 1 or recipe='tensor'")
    x32 = x.to(torch.float32)
    if x32.numel() == 0:  # nothing to scale: amax 0, scale 1, as for an all-zero tensor
        amax = x32.new_zeros(() if recipe == "tensor" else x32.shape[:-1])
    else:
        amax = x32.abs().amax() if recipe == "tensor" else x32.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise InvalidProblem(
            "x contains inf or NaN, so its scale is undefined; clean it (torch.nan_to_num) before quantising"
        )
    # amax / fp8_max underflows to 0 for amax below ~1e-36: the smallest normal scale keeps 0 / scale at 0, not NaN.
    scale = torch.where(amax > 0, (amax / info.fp8_max).clamp_min(torch.finfo(torch.float32).tiny),
                        torch.ones_like(amax))
    scaled = x32 / (scale if recipe == "tensor" else scale.unsqueeze(-1))
    data = scaled.clamp(-info.fp8_max, info.fp8_max).to(info.dtype)
    return Quantized(data, scale, amax, recipe)


def linear(
    xq: Quantized, wq: Quantized, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    pad: bool = True,
) -> torch.Tensor:
    """``xq @ wq^T (+ bias)`` from quantized operands, fp32 accumulation, in ``out_dtype``.

    ``xq`` is ``[..., K]``; ``wq`` is ``[out, K]``.  Tensor-wise and row-wise
    scales mix freely: a row-wise ``wq`` has one scale per output feature.
    K and ``out`` off a multiple of 16 are zero-padded inside; ``pad=False``
    raises :class:`MisalignedOperand` for them instead.
    """
    for name, q in (("xq", xq), ("wq", wq)):
        if not isinstance(q, Quantized):
            raise InvalidProblem(
                f"{name} is a {type(q).__name__}; it must be a kernelplan.fp8.Quantized: build it with "
                f"kernelplan.fp8.quantize(t, recipe=...)"
            )
    if wq.data.dim() != 2:
        raise InvalidProblem(f"wq has shape {tuple(wq.data.shape)}; it must be [out, in] (nn.Linear layout)")
    a_scale = xq.scale if xq.recipe == "tensor" else xq.scale.reshape(-1)
    scales = ScaleSet(a=a_scale, b=wq.scale)
    return _linear(xq.data, wq.data, bias, scales=scales, out_dtype=out_dtype, pad=pad)
