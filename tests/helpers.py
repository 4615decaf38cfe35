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


class StubDriver:
    """cuLaunchKernel that records each launch: its grid, block, shared bytes, stream and each parameter slot's
    bytes (``sizes``: the parameters' byte sizes)."""

    def __init__(self, sizes, error=0):
        self.sizes, self.error, self.launches = sizes, error, []

    def CUstream(self, raw):  # noqa: N802 (cuda-bindings' name)
        return ("stream", raw)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # noqa: N802
        import ctypes

        slots = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        self.launches.append(((gx, gy, gz), bx, shared, stream,
                              [ctypes.string_at(slots[i], size) for i, size in enumerate(self.sizes)]))
        return (self.error,)


def stub_driver(monkeypatch, types, error=0) -> StubDriver:
    """``kernels.direct`` launching into a ``StubDriver`` for parameters of Triton types ``types``."""
    from kernelplan.kernels import direct

    stub = StubDriver([direct._SIZE.get(t, 8) for t in types], error)
    monkeypatch.setattr(direct, "_driver", lambda: stub)
    monkeypatch.setattr(direct, "_STREAMS", {})  # the stub's streams never reach a real launch's cache
    return stub
