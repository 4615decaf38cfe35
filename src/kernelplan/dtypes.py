"""One table of the dtypes kernelplan knows, instead of one code path per dtype.

Each op says which names it supports; everything else (compute dtype, short
name, byte size, fp8 range) is looked up here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidProblem


@dataclass(frozen=True)
class DTypeInfo:
    dtype: torch.dtype
    name: str  # the short name used in SKUs, cache keys and error messages
    compute: torch.dtype  # what the math runs in: fp32, or fp64 for fp64
    itemsize: int
    fp8_max: float | None = None  # largest finite value, for the fp8 formats


DTYPES: dict[torch.dtype, DTypeInfo] = {
    info.dtype: info
    for info in (
        DTypeInfo(torch.float64, "f64", torch.float64, 8),
        DTypeInfo(torch.float32, "f32", torch.float32, 4),
        DTypeInfo(torch.float16, "f16", torch.float32, 2),
        DTypeInfo(torch.bfloat16, "bf16", torch.float32, 2),
        DTypeInfo(torch.float8_e4m3fn, "e4m3", torch.float32, 1, fp8_max=448.0),
        DTypeInfo(torch.float8_e5m2, "e5m2", torch.float32, 1, fp8_max=57344.0),
    )
}
_BY_NAME = {info.name: info for info in DTYPES.values()}

FLOAT_DTYPES = ("f64", "f32", "f16", "bf16")
FP8_DTYPES = ("e4m3", "e5m2")


def dtype_info(dtype: torch.dtype | str, operand: str = "dtype", allowed=None) -> DTypeInfo:
    """Look ``dtype`` up, raising :class:`InvalidProblem` that names ``operand``.

    ``allowed`` restricts the answer to a tuple of short names.
    """
    info = _BY_NAME.get(dtype) if isinstance(dtype, str) else DTYPES.get(dtype)
    if info is None or (allowed is not None and info.name not in allowed):
        names = allowed if allowed is not None else tuple(_BY_NAME)
        raise InvalidProblem(
            f"{operand} has dtype {dtype}, which is not supported here; "
            f"it must be one of {', '.join(names)}: convert it with .to(...)"
        )
    return info


def is_fp8(dtype: torch.dtype) -> bool:
    info = DTYPES.get(dtype)
    return info is not None and info.fp8_max is not None
