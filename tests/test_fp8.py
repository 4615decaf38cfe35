"""``kernelplan.fp8``: quantize round trips, the fp8 linear's signal-to-noise, error inputs."""

from __future__ import annotations

import math

import pytest
import torch

import kernelplan as kp
from kernelplan.errors import InvalidProblem

# (dtype, relative half-step of a normal number, absolute half-step of the subnormals)
FORMATS = [(torch.float8_e4m3fn, 2.0**-4, 2.0**-10), (torch.float8_e5m2, 2.0**-3, 2.0**-17)]


@pytest.mark.parametrize("recipe", ["tensor", "rowwise"])
@pytest.mark.parametrize("dtype, rel, sub", FORMATS, ids=["e4m3", "e5m2"])
def test_round_trip_stays_within_the_rounding_interval(recipe, dtype, rel, sub, seed):
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 3, 64)  # magnitudes across the range, 3-D
    q = kp.fp8.quantize(x, recipe, dtype)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    scale = q.scale if recipe == "tensor" else q.scale.unsqueeze(-1)
    bound = torch.maximum(x.abs() * rel, scale * sub) * (1 + 1e-6)
    assert ((q.dequantize() - x).abs() <= bound).all()
    want_amax = x.abs().amax() if recipe == "tensor" else x.abs().amax(-1)
    torch.testing.assert_close(q.amax, want_amax)
    assert q.data.float().abs().amax() == kp.dtypes.dtype_info(dtype).fp8_max  # the range is used fully


def test_zero_rows_get_scale_one_and_stay_zero():
    x = torch.zeros(4, 16)
    x[1] = torch.randn(16)
    q = kp.fp8.quantize(x, "rowwise")
    assert q.scale[0] == 1 and q.scale[2] == 1 and (q.dequantize()[[0, 2, 3]] == 0).all()


@pytest.mark.parametrize("recipes", [("tensor", "tensor"), ("rowwise", "rowwise"), ("rowwise", "tensor")])
@pytest.mark.parametrize("dtype, floor_db", [(torch.float8_e4m3fn, 25.0), (torch.float8_e5m2, 20.0)], ids=["e4m3", "e5m2"])
def test_fp8_linear_signal_to_noise_against_fp64(recipes, dtype, floor_db, seed):
    x, w, b = torch.randn(2, 32, 256), torch.randn(96, 256) / 16, torch.randn(96).bfloat16()
    y = kp.fp8.linear(kp.fp8.quantize(x, recipes[0], dtype), kp.fp8.quantize(w, recipes[1], dtype), b)
    assert y.shape == (2, 32, 96) and y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + b.double()
    snr = 10 * math.log10(float((ref**2).sum() / ((y.double() - ref) ** 2).sum()))
    assert snr >= floor_db, f"SNR {snr:.1f} dB"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: kp.fp8.quantize(torch.randn(4, 4), "blockwise"), r"recipe is 'blockwise'"),
        (lambda: kp.fp8.quantize(torch.ones(4, 4, dtype=torch.int32)), r"x has dtype torch.int32"),
        (lambda: kp.fp8.quantize(torch.tensor([1.0, float("inf")])), r"inf or NaN"),
        (lambda: kp.fp8.quantize(torch.randn(4), dtype=torch.bfloat16), r"dtype"),
        (lambda: kp.fp8.quantize(torch.tensor(2.0), "rowwise"), r"x is 0-d"),
        (lambda: kp.fp8.linear(torch.randn(4, 4), kp.fp8.quantize(torch.randn(4, 4))), r"xq is a Tensor"),
        (lambda: kp.fp8.linear(kp.fp8.quantize(torch.randn(4, 4)), kp.fp8.quantize(torch.randn(2, 4, 4))),
         r"wq has shape \(2, 4, 4\)"),
    ],
)
def test_error_inputs(call, match):
    with pytest.raises(InvalidProblem, match=match):
        call()
