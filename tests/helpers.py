"""Comparison helpers: fp64 oracles and per-dtype tolerance tables."""

from __future__ import annotations

import pytest
import torch

# Floors added to "2 x the same-dtype torch error", relative to max |oracle|.
# Forward and backward are kept apart: backward chains more roundings.
FWD_ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
BWD_ATOL = {torch.float64: 1e-11, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(out: torch.Tensor, oracle: torch.Tensor) -> float:
    if oracle.numel() == 0:
        return 0.0
    scale = oracle.detach().double().abs().max().clamp_min(1e-30)
    return float((out.detach().double() - oracle.detach().double()).abs().max() / scale)


def assert_close(out, oracle, baseline, *, atol: float, what: str = "output") -> None:
    """``out`` within 2x the error of the same-dtype torch ``baseline`` + ``atol`` (flash-attn's bar)."""
    assert out.shape == oracle.shape, f"{what}: shape {tuple(out.shape)} != {tuple(oracle.shape)}"
    assert out.dtype == baseline.dtype, f"{what}: dtype {out.dtype} != {baseline.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err, base = rel_err(out, oracle), rel_err(baseline, oracle)
    assert err <= 2 * base + atol, f"{what}: rel err {err:.3e} > 2 x torch's {base:.3e} + {atol:.1e}"


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN (True for bool), to prove every element gets written."""
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)


# Skips a test off Hopper: the wgmma.sp kernels are sm_90a code.
sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 (Hopper) GPU")
