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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kind, approximate", [("glu", "none"), ("reglu", "none"), ("swiglu", "none"),
                                               ("geglu", "none"), ("geglu", "tanh")])
@pytest.mark.parametrize("gate", ["second", "first"])
def test_gated_triton_bf16_and_f64(kind, approximate, gate, dtype):
    from test_gated_triton import _check, _layouts, _run

    torch.manual_seed(0)
    for desc, x, dim in _layouts(dtype):
        assert kp.GatedActivationPlan.select(
            kp.gated._descriptor(x, kind, dim % x.dim(), gate, approximate)).sku.backend == "triton"
        _check(x, kind, dim, gate, approximate, *_run(x, kind, dim, gate, approximate))


def test_gated_triton_above_2_31_elements():
    """x has 2**31 + 256 elements: offsets past 2**31 must be formed in 64 bits."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.randn(2, 2**30 + 128, device="cuda", dtype=torch.bfloat16)
    y = kp.gated_activation(x, "swiglu", gate="first")
    dy = torch.ones_like(y)
    dx = kp.gated_activation_backward(dy, x, "swiglu", gate="first")
    half = x.shape[-1] // 2
    for lo in (0, half - 4096):  # the start and the far end of each half
        a = x[:, lo:lo + 4096].float()
        b = x[:, half + lo:half + lo + 4096].float()
        torch.testing.assert_close(y[:, lo:lo + 4096].float(), (torch.nn.functional.silu(a) * b).bfloat16().float(),
                                   rtol=1e-2, atol=1e-2)  # one bf16 ulp; a wrong address is far off
        torch.testing.assert_close(dx[:, half + lo:half + lo + 4096].float(),
                                   torch.nn.functional.silu(a).bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_gated_compiles_with_inductor_fullgraph():
    torch._dynamo.reset()
    mlp = kp.nn.GatedMLP(256, 512, kind="swiglu", device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled(x).float().square().sum().backward()
    g = x.grad.clone()
    x.grad = None
    mlp(x).float().square().sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=2e-2, atol=2e-2)
