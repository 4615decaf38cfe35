"""The fp8 GEMM backend on torch._scaled_mm against an fp64 oracle (on CPU: torch's CPU _scaled_mm, by name)."""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned
from kernelplan.gemm import GemmArgs, GemmDescriptor, GemmPlan, ScaleSet

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ONLY = kp.PlanPreference.only("scaled_mm")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _operands(m, n, k, a_fmt, recipe_a, recipe_b):
    """fp8 A [m, k] and B [n, k] with their dequantisation scales, and the fp64 dequantised values."""
    a = torch.randn(m, k, device=DEV) * 3
    b = torch.randn(n, k, device=DEV) / 2
    qa = kp.fp8.quantize(a, recipe_a, dtype=FP8[a_fmt])
    qb = kp.fp8.quantize(b, recipe_b)
    return qa, qb, qa.dequantize(torch.float64), qb.dequantize(torch.float64)


def _run(desc, args, backend):
    GemmPlan.select(desc, kp.PlanPreference.only(backend)).run(args)
    return args.d


@pytest.mark.parametrize("recipes", [("tensor", "tensor"), ("rowwise", "rowwise"), ("rowwise", "tensor"),
                                     ("tensor", "rowwise")])
@pytest.mark.parametrize("a_fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64(recipes, a_fmt, bias, seed):
    m, n, k = 37, 48, 64  # odd m: only k and n have the 16 rule
    qa, qb, a64, b64 = _operands(m, n, k, a_fmt, *recipes)
    bias_t = torch.randn(n, device=DEV).bfloat16() if bias else None
    scales = ScaleSet(a=qa.scale, b=qb.scale)
    desc = GemmDescriptor(m, n, k, a_fmt, b_dtype="e4m3", out_dtype="bf16", epilogue="bias" if bias else "none",
                          transb=True, scale_a=scales.mode("a", m), scale_b=scales.mode("b", n), device=DEV)
    d = _run(desc, GemmArgs(qa.data, qb.data, poisoned((m, n), torch.bfloat16, DEV), bias=bias_t, scales=scales),
             "scaled_mm")
    oracle = a64 @ b64.T + (bias_t.double() if bias else 0)
    ref = _run(desc, GemmArgs(qa.data, qb.data, poisoned((m, n), torch.bfloat16, DEV), bias=bias_t, scales=scales),
               "reference")
    assert_close(d, oracle, ref, atol=FWD_ATOL[torch.bfloat16])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_tensorwise_out_dtypes_alpha_and_a_strided_a(out_dtype, seed):
    m, n, k = 16, 32, 48
    qa, qb, a64, b64 = _operands(m, n, k, "e4m3", "tensor", "tensor")
    a_strided = qa.data.t().contiguous().t()  # [m, k] column-major: copied inside
    scales = ScaleSet(a=qa.scale, b=qb.scale)
    desc = GemmDescriptor(m, n, k, "e4m3", out_dtype=kp.dtypes.dtype_info(out_dtype).name, transb=True,
                          scale_a="tensor", scale_b="tensor", device=DEV)
    d = _run(desc, GemmArgs(a_strided, qb.data, poisoned((m, n), out_dtype, DEV), alpha=0.5, scales=scales),
             "scaled_mm")
    ref = _run(desc, GemmArgs(qa.data, qb.data, poisoned((m, n), out_dtype, DEV), alpha=0.5, scales=scales),
               "reference")
    assert_close(d, 0.5 * a64 @ b64.T, ref, atol=_atol(out_dtype))


def _atol(out_dtype):
    """Hopper's fp8 tensor cores keep about 14 mantissa bits in their accumulator (measured 9.8e-5
    relative at k = 48 on an H200): an f32 D from the GPU carries that, not f32 rounding."""
    if out_dtype == torch.float32 and DEV == "cuda":
        return 2.5e-4
    return FWD_ATOL[out_dtype]


@pytest.mark.parametrize("change, reason", [
    (dict(epilogue="relu_bias"), r"only none and bias"),
    (dict(out_dtype="f16", scale_a="vector"), r"row-wise scales give a bf16 D"),
    (dict(out_dtype="f32", epilogue="bias"), r"no bias to an f32 D"),
    (dict(has_c=True), r"C, an output scale and amax"),
    (dict(dtype="e5m2", b_dtype="e5m2"), r"both e5m2"),
    (dict(transb=False), r"nn.Linear layout"),
])
def test_refusals_are_reasons(change, reason):
    base = dict(m=32, n=48, k=64, dtype="e4m3", b_dtype="e4m3", out_dtype="bf16", transb=True,
                scale_a="tensor", scale_b="tensor", device=DEV)
    with pytest.raises(kp.Unsupported, match=reason):
        GemmPlan.select(GemmDescriptor(**{**base, **change}), ONLY)


@pytest.mark.parametrize("recipes", [("rowwise", "rowwise"), ("tensor", "tensor")])
def test_unaligned_k_and_n_are_padded_inside(recipes, seed):
    m, n, k = 5, 40, 56  # neither n nor k a multiple of 16
    qa, qb, a64, b64 = _operands(m, n, k, "e4m3", *recipes)
    bias_t = torch.randn(n, device=DEV).bfloat16()
    scales = ScaleSet(a=qa.scale, b=qb.scale)
    desc = GemmDescriptor(m, n, k, "e4m3", out_dtype="bf16", epilogue="bias", transb=True,
                          scale_a=scales.mode("a", m), scale_b=scales.mode("b", n), device=DEV)
    d = _run(desc, GemmArgs(qa.data, qb.data, poisoned((m, n), torch.bfloat16, DEV), bias=bias_t, scales=scales),
             "scaled_mm")
    ref = _run(desc, GemmArgs(qa.data, qb.data, poisoned((m, n), torch.bfloat16, DEV), bias=bias_t, scales=scales),
               "reference")
    assert_close(d, a64 @ b64.T + bias_t.double(), ref, atol=FWD_ATOL[torch.bfloat16])


def test_dispatch_default():
    """On CUDA fp8 GEMMs go to _scaled_mm; on CPU the reference stays the default."""
    desc = GemmDescriptor(32, 48, 64, "e4m3", out_dtype="bf16", transb=True, scale_a="tensor",
                          scale_b="tensor", device=DEV)
    assert GemmPlan.select(desc).sku.backend == ("scaled_mm" if DEV == "cuda" else "reference")
