"""GEMM epilogue semantics: a training step built from epilogues equals autograd; fp8 scaling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned, rel_err
from kernelplan.errors import InvalidProblem, Unsupported

ACT = {"gelu": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}


@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_mlp_training_step_from_epilogues_equals_autograd(act, dtype):
    """Forward with *_AUX_BIAS, backward with D*_BGRAD and BGRAD, against fp64 autograd."""
    n, d_in, hidden, d_out = 6, 16, 24, 8
    x, w1, b1 = torch.randn(n, d_in), torch.randn(hidden, d_in) / 4, torch.randn(hidden)
    w2, b2, dy = torch.randn(d_out, hidden) / 4, torch.randn(d_out), torch.randn(n, d_out)
    lo = [t.to(dtype) for t in (x, w1, b1, w2, b2, dy)]
    xl, w1l, b1l, w2l, b2l, dyl = lo

    h, z1 = kp.linear(xl, w1l, b1l, f"{act}_aux_bias")
    y = kp.linear(h, w2l, b2l, "bias")
    dz1, db1 = kp.linear(dyl, w2l.T.contiguous(), None, f"d{act}_bgrad", aux=z1)  # dY @ W2, times act'(Z1)
    dw2, db2 = kp.linear(dyl.T.contiguous(), h.T.contiguous(), None, "bgrad")  # dY^T @ H, and sum of dY
    dw1 = kp.linear(dz1.T.contiguous(), xl.T.contiguous())  # dZ1^T @ X
    dx = kp.linear(dz1, w1l.T.contiguous())

    # The oracle sees the same (rounded) inputs: from the unrounded ones, a relu pre-activation
    # near 0 can change sign between the two, which no kernel could match.
    leaves = [t.double().requires_grad_() for t in lo[:5]]
    x64, w1_64, b1_64, w2_64, b2_64 = leaves
    y64 = F.linear(ACT[act](F.linear(x64, w1_64, b1_64)), w2_64, b2_64)
    y64.backward(dyl.double())
    atol = 4 * FWD_ATOL[dtype]
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for name, ours, oracle in [
        ("y", y, y64.detach()),
        ("dx", dx, x64.grad),
        ("dw1", dw1, w1_64.grad),
        ("db1", db1, b1_64.grad),
        ("dw2", dw2, w2_64.grad),
        ("db2", db2, b2_64.grad),
    ]:
        assert ours.shape == oracle.shape, name
        assert oracle.norm() > 1e-3, f"{name} oracle is trivially small"
        assert rel_err(ours, oracle) <= tol + atol, f"{name}: {rel_err(ours, oracle):.3e}"
    assert z1.dtype == (torch.bool if act == "relu" else dtype)


def test_aux_contents_are_documented_values():
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    z = F.linear(x, w, b)
    d, aux = kp.linear(x, w, b, "gelu_aux_bias")
    torch.testing.assert_close(aux, z)
    torch.testing.assert_close(d, F.gelu(z, approximate="tanh"))
    d, mask = kp.linear(x, w, b, kp.Epilogue.RELU_AUX_BIAS)
    assert mask.dtype == torch.bool and torch.equal(mask, z > 0)
    d, aux = kp.linear(x, w, None, "relu_aux")
    assert torch.equal(aux, F.linear(x, w) > 0)


def test_explicit_out_alpha_beta_c_and_3d():
    x, w, c = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(2, 3, 5)
    out = poisoned((2, 3, 5), torch.float32)
    ret = kp.linear(x, w, epilogue="none", alpha=0.25, beta=3.0, c=c, out=out)
    assert ret is out and not torch.isnan(out).any()
    torch.testing.assert_close(out, 0.25 * F.linear(x, w) + 3.0 * c)


def test_errors_write_nothing_into_out():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    out = poisoned((4, 6), torch.float32)
    with pytest.raises(InvalidProblem, match="bias has shape"):
        kp.linear(x, w, torch.randn(7), "bias", out=out)
    with pytest.raises(InvalidProblem, match="aux is None"):
        kp.linear(x, w, None, "dgelu", out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w, out: kp.linear(x, torch.randn(6, 7), out=out), InvalidProblem, r"w must be \[out, in\]"),
    (lambda x, w, out: kp.linear(x, w, None, "dgelu", aux=torch.zeros(4, 8, dtype=torch.float64), out=out),
     InvalidProblem, r"aux has dtype torch.float64 but must have dtype torch.float32"),
    (lambda x, w, out: kp.linear(x, w, None, "drelu", aux=torch.zeros(4, 8), out=out),
     InvalidProblem, r"aux has dtype torch.float32 but must have dtype torch.bool"),
    (lambda x, w, out: kp.linear(out, w, out=out), InvalidProblem, r"D shares memory with A"),
    (lambda x, w, out: kp.linear(x.to(torch.float8_e4m3fn), torch.randn(8, 8).to(torch.float8_e4m3fn),
                                 out_dtype=torch.float32, out=out, pad=False),
     kp.MisalignedOperand, r"k is 8; fp8 GEMMs .* multiples of 16.*zero-pad k to 16.*pass pad=True"),
])
def test_error_inputs_name_the_fix_and_write_nothing(call, error, match):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    out = poisoned((4, 8), torch.float32)
    with pytest.raises(error, match=match):
        call(x, w, out)
    assert torch.isnan(out).all()


def test_fp8_pad_false_runs_aligned_dims():
    xq, wq = kp.fp8.quantize(torch.randn(4, 32)), kp.fp8.quantize(torch.randn(48, 32))
    torch.testing.assert_close(kp.fp8.linear(xq, wq, pad=False), kp.fp8.linear(xq, wq))
    with pytest.raises(kp.MisalignedOperand, match="n is 40"):
        kp.fp8.linear(xq, kp.fp8.quantize(torch.randn(40, 32)), pad=False)


def test_inference_fast_path_skips_checks_and_keeps_shapes(monkeypatch, seed):
    """A repeated plain linear skips the checks, returns the caller's leading shape, and never outlives a change."""
    import kernelplan.gemm.functional as functional

    checks = []
    monkeypatch.setattr(functional, "check_tensor", lambda *a, real=functional.check_tensor, **k: checks.append(1) or real(*a, **k))
    w, bias = torch.randn(24, 40), torch.randn(24)
    for x in (torch.randn(7, 40), torch.randn(2, 40, 5).transpose(1, 2), torch.randn(9, 80)[:, ::2]):
        with torch.no_grad():
            kp.linear(x, w, bias)
            checks.clear()
            for _ in range(2):  # new values in the same layout: both calls take the fast path
                x.copy_(torch.randn(x.shape))
                y = kp.linear(x, w, bias)
                assert_close(y, F.linear(x.double(), w.double(), bias.double()), F.linear(x, w, bias),
                             atol=FWD_ATOL[torch.float32])
                assert y.shape == (*x.shape[:-1], 24)
            assert not checks, "a repeated call with the same layout takes the fast path"
    # Another layout of a known problem: still the fast path (backends take any strides), still right.
    with torch.no_grad():
        for x in (torch.randn(40, 7).t(), torch.randn(7, 80)[:, 1::2], torch.randn(7, 40)):
            y = kp.linear(x, w, torch.stack([bias, bias], 1).reshape(-1)[::2])  # bias with stride 2
            assert_close(y, F.linear(x.double(), w.double(), bias.double()), F.linear(x, w, bias),
                         atol=FWD_ATOL[torch.float32])
    assert not checks, "a new layout of a known problem takes the fast path"
    # The same layout in another dtype is another entry: the checks run and name the mismatch.
    with torch.no_grad(), pytest.raises(InvalidProblem, match="w"):
        kp.linear(torch.randn(7, 40), w.double(), bias)
    assert checks


def test_autograd_guards():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8)
    with pytest.raises(Unsupported, match="epilogue BGRAD .* not differentiable"):
        kp.linear(x, w, None, "bgrad")
    with pytest.raises(InvalidProblem, match="out= does not support autograd"):
        kp.linear(x, w, out=torch.empty(3, 4))
    d, aux = kp.linear(x, w, torch.randn(4), "gelu_aux_bias")
    assert d.requires_grad and not aux.requires_grad


def _quantize(t, fp8, dim=None):
    """Per-tensor or per-row scales such that t ~= q * scale."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim)
    scale = amax.clamp_min(1e-12) / kp.dtypes.dtype_info(fp8).fp8_max
    q = (t / (scale if dim is None else scale.unsqueeze(dim))).to(fp8)
    return q, scale.float()


@pytest.mark.parametrize("recipe", ["tensor", "rowwise"])
@pytest.mark.parametrize("formats", [(torch.float8_e4m3fn,) * 2, (torch.float8_e5m2, torch.float8_e4m3fn)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_scaled_linear_matches_dequantised_fp64(recipe, formats, out_dtype):
    x, w, b = torch.randn(2, 5, 32), torch.randn(12, 32), torch.randn(12).to(torch.bfloat16)
    dim = None if recipe == "tensor" else -1
    xq, sx = _quantize(x, formats[0], dim)
    wq, sw = _quantize(w, formats[1], dim)
    sx2 = sx if dim is None else sx.reshape(-1)
    amax = torch.zeros((), dtype=torch.float32)
    scales = kp.ScaleSet(a=sx2, b=sw, amax=amax)
    if out_dtype == torch.float32:
        b = b.float()
    y = kp.linear(xq, wq, b, "gelu_bias", scales=scales, out_dtype=out_dtype)
    xd = xq.double() * (sx.double() if dim is None else sx.double().unsqueeze(-1))
    wd = wq.double() * (sw.double() if dim is None else sw.double().unsqueeze(-1))
    oracle = F.gelu(F.linear(xd, wd, b.double()), approximate="tanh")
    baseline = F.gelu(F.linear(xd.to(out_dtype), wd.to(out_dtype), b), approximate="tanh")
    assert y.dtype == out_dtype
    assert_close(y, oracle, baseline, atol=FWD_ATOL[out_dtype])
    torch.testing.assert_close(amax.double(), oracle.abs().max(), rtol=1e-5, atol=0)
    # and the quantised product is as close to the unquantised one as quantising allows: the kernel's signal-to-noise
    # within 1 dB of the dequantised fp64 product's (0.2 dB at most over 300 draws of each case, bf16's rounding).
    # Quantising alone reads down to 24.7 dB (e4m3) and 20.1 dB (e5m2 x) over 3000 draws of these shapes, so a fixed
    # bar of 25 dB failed on about 0.1% of draws (CI at 88d0ade: 24.8 dB); the floors sit under those.
    exact = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")

    def snr(t):
        return float(10 * torch.log10(exact.pow(2).sum() / (t.double() - exact).pow(2).sum()))

    assert snr(y) > snr(oracle) - 1.0, f"SNR {snr(y):.1f} dB, the dequantised product's {snr(oracle):.1f} dB"
    assert snr(y) > (20 if formats[0] == torch.float8_e4m3fn else 15), f"SNR {snr(y):.1f} dB"


def test_fp8_output_is_scaled_and_saturated():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    z = F.linear(xq.double(), wq.double())
    amax = torch.zeros(1)
    s_out = 448.0 / float(z.abs().max()) * 4  # deliberately overflowing: must saturate, not NaN
    d = kp.linear(xq, wq, scales=kp.ScaleSet(out=s_out, amax=amax), out_dtype=torch.float8_e4m3fn)
    assert d.dtype == torch.float8_e4m3fn and torch.isfinite(d.float()).all()
    expected = (z * s_out).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    assert torch.equal(d.float(), expected.float())
    assert float(d.float().abs().max()) == 448.0
    torch.testing.assert_close(amax.double(), z.abs().max().reshape(1), rtol=1e-6, atol=0)


def test_fp8_scale_errors():
    xq, wq = torch.randn(4, 16).to(torch.float8_e4m3fn), torch.randn(8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidProblem, match=r"scales.b has shape \(4,\).*length 8"):
        kp.linear(xq, wq, scales=kp.ScaleSet(b=torch.ones(4)), out_dtype=torch.bfloat16)
    with pytest.raises(InvalidProblem, match="scales.out was given but D is bf16"):
        kp.linear(xq, wq, scales=kp.ScaleSet(out=2.0), out_dtype=torch.bfloat16)
    with pytest.raises(InvalidProblem, match="scales.amax has shape"):
        kp.linear(xq, wq, scales=kp.ScaleSet(amax=torch.zeros(2)), out_dtype=torch.bfloat16)
    with pytest.raises(InvalidProblem, match="out_dtype has dtype f64.*f32, f16, bf16, e4m3, e5m2"):
        kp.linear(xq, wq, out_dtype=torch.float64)


def test_gpu_backends_are_registered_and_say_why_they_cannot_run_here():
    """The GPU backends register on import everywhere; on a CPU descriptor each names its reason."""
    from kernelplan.gemm import GemmDescriptor, GemmPlan

    assert {"reference", "cublaslt", "scaled_mm"} <= set(GemmPlan.registry.names())
    with pytest.raises(Unsupported, match="cublaslt: cuBLASLt runs on CUDA devices only"):
        GemmPlan.select(GemmDescriptor(4, 8, 16, "f32", transb=True, device="cpu"), kp.PlanPreference.only("cublaslt"))
