"""Every GPU path on a device that is not the current one, and one problem on two devices.

Triton, cuBLASLt and cuSPARSELt launch into the current device's context, where
torch's ops follow their tensors.  These run each op on cuda:0 and cuda:1 with
the other device current, the same shapes on both, so that a kernel compiled,
a plan built or a route cached on one device is never taken on the other.
Skipped without two CUDA devices.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

# (device the data is on, device current while the op runs): each problem runs on both in turn.
PAIRS = [(1, 0), (0, 1)]
SPARSE_BACKENDS = ["triton", "triton_bfe", "triton_m128", "dense", "cusparselt"]


def _on_each_device(run):
    """``run(device)`` for cuda:1 then cuda:0, with the other device current; the current device is restored."""
    for data, current in PAIRS:
        with torch.cuda.device(current):
            run(torch.device("cuda", data))
            assert torch.cuda.current_device() == current


@pytest.mark.parametrize("bias", [False, True])
def test_linear_fast_path_and_epilogues(bias, seed):
    def run(dev):
        x = torch.randn(3, 5, 256, device=dev, dtype=torch.bfloat16)  # 3-D
        w = torch.randn(192, 256, device=dev, dtype=torch.bfloat16) / 16
        b = torch.randn(192, device=dev, dtype=torch.bfloat16) if bias else None
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        for _ in range(3):  # the first call plans and tunes; the next take linear()'s fast path
            y = kp.linear(x, w, b)
            assert y.device == dev
            assert_close(y, ref, F.linear(x, w, b), atol=FWD_ATOL[torch.bfloat16])
        y, z = kp.linear(x, w, b, "gelu_aux_bias" if bias else "gelu_aux")
        assert_close(y, F.gelu(ref, approximate="tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"),
                     atol=FWD_ATOL[torch.bfloat16])
        assert z.device == dev

    _on_each_device(run)


def test_fused_linear_training_step(seed):
    def run(dev):
        torch.manual_seed(1)
        layer = kp.nn.FusedLinear(128, 96, activation="gelu", device=dev, dtype=torch.bfloat16)
        x = torch.randn(2, 40, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(2, 40, 96, device=dev, dtype=torch.bfloat16)
        got = torch.autograd.grad(layer(x), (x, layer.weight, layer.bias), dy)
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
        want = torch.autograd.grad(F.gelu(F.linear(x64, w64, b64), approximate="tanh"), (x64, w64, b64), dy.double())
        same = torch.autograd.grad(F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"),
                                   (x, layer.weight, layer.bias), dy)
        for name, g, r, s in zip(("dx", "dW", "db"), got, want, same):
            assert g.device == dev
            assert_close(g, r, s, atol=BWD_ATOL[torch.bfloat16], what=name)

    _on_each_device(run)


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
def test_sparse24_backends(backend, seed):
    if backend == "cusparselt" and importlib.util.find_spec("nvmath") is None:
        pytest.skip("nvmath-python is not installed: the cuSPARSELt backend needs it")

    def run(dev):
        w = kp.sparse24.prune(torch.randn(256, 512, device=dev, dtype=torch.bfloat16))
        w24 = kp.sparse24.compress(w)
        x = torch.randn(48, 512, device=dev, dtype=torch.bfloat16)
        b = torch.randn(256, device=dev, dtype=torch.bfloat16)
        desc = GemmSparse24Descriptor(48, 256, 512, "bf16", "relu", True, str(dev))
        plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only(backend))
        y = torch.full((48, 256), float("nan"), device=dev, dtype=torch.bfloat16)
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, b))
        assert_close(y, F.relu(F.linear(x.double(), w.double(), b.double())), F.relu(F.linear(x, w, b)),
                     atol=FWD_ATOL[torch.bfloat16], what=f"{backend} on {dev}")

    _on_each_device(run)


def test_sparse24_functional_path_tunes_on_the_weights_device(seed):
    def run(dev):
        w = kp.sparse24.prune(torch.randn(512, 1024, device=dev, dtype=torch.float16))
        w24 = kp.sparse24.compress(w)
        x = torch.randn(7, 1024, device=dev, dtype=torch.float16)
        ref = F.linear(x.double(), w.double())
        for _ in range(3):  # tuning, then the fast path
            y = kp.sparse24.linear(x, w24)
            assert y.device == dev
            assert_close(y, ref, F.linear(x, w), atol=FWD_ATOL[torch.float16])

    _on_each_device(run)


def test_gated_activation_forward_and_backward(seed):
    def run(dev):
        x = torch.randn(6, 33, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = kp.gated_activation(x, "swiglu", dim=-1, gate="first")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        x64 = x.detach().double().requires_grad_()
        a, b = x64.chunk(2, -1)
        want = F.silu(a) * b
        (dx64,) = torch.autograd.grad(want, x64, dy.double())
        xs = x.detach().requires_grad_()
        a_s, b_s = xs.chunk(2, -1)
        same = F.silu(a_s) * b_s
        (dxs,) = torch.autograd.grad(same, xs, dy)
        assert_close(y, want, same, atol=FWD_ATOL[torch.bfloat16], what="y")
        assert_close(dx, dx64, dxs, atol=BWD_ATOL[torch.bfloat16], what="dx")

    _on_each_device(run)


def test_fp8_linear(seed):
    def run(dev):
        x, w = torch.randn(64, 256, device=dev), torch.randn(128, 256, device=dev) / 16
        y = kp.fp8.linear(kp.fp8.quantize(x, "rowwise"), kp.fp8.quantize(w, "rowwise"))
        assert y.device == dev
        ref = x.double() @ w.double().T
        snr = 10 * math.log10(float((ref**2).sum() / ((y.double() - ref) ** 2).sum()))
        assert snr >= 25.0, f"SNR {snr:.1f} dB on {dev}"

    _on_each_device(run)

