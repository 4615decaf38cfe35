"""The reference backends on a CUDA device (bf16 and f64 included).  Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from opinfo import OPS
from test_opinfo import _cast_sample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_ops_on_cuda_match_fp64(op, dtype):
    torch.manual_seed(0)
    for sample in op.samples("cuda", dtype):
        out = op.op(*sample.args, **sample.kwargs)
        assert out.device.type == "cuda"
        args64, kwargs64 = _cast_sample(sample, torch.float64)
        assert_close(out, op.reference(*args64, **kwargs64), op.reference(*sample.args, **sample.kwargs),
                     atol=FWD_ATOL[dtype], what=sample.desc)


def test_sku_names_the_gpu_arch():
    plan = kp.GemmPlan.select(kp.GemmDescriptor(16, 32, 64, "bf16", device="cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert plan.sku.arch == f"sm{major}{minor}"


def test_gated_backward_on_cuda():
    x = torch.randn(64, 3, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = kp.gated_activation(x, "swiglu", dim=-1, gate="first")
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    a, b = x64.chunk(2, -1)
    (torch.nn.functional.silu(a) * b).backward(dy.double())
    xb = x.detach().clone().requires_grad_()
    ab, bb = xb.chunk(2, -1)
    (torch.nn.functional.silu(ab) * bb).backward(dy)
    assert_close(x.grad, x64.grad, xb.grad, atol=BWD_ATOL[torch.bfloat16])


def test_plan_runs_on_a_side_stream():
    desc = kp.GatedActivationDescriptor("geglu", (128, 64), 1, "f32", device="cuda:0")
    x = torch.randn(128, 64, device="cuda")
    y = torch.empty(128, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    kp.GatedActivationPlan.select(desc).run(kp.GatedActivationArgs(x, y), stream=s)
    torch.cuda.current_stream().wait_stream(s)
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(y, a * torch.nn.functional.gelu(b))
