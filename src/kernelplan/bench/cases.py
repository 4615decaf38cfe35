"""The cases ``kernelplan bench`` runs: small shapes on CPU, model shapes on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kernelplan as kp


@dataclass
class Case:
    name: str
    dtype: torch.dtype
    run_kp: Callable[[], tuple]  # returns (output, backend name) on the first call, output after
    run_torch: Callable[[], torch.Tensor]
    oracle: torch.Tensor  # fp64
    atol: float
    # The case's GEMMs alone, where it is more than GEMMs, by whose GEMMs ({"torch": fn, "kp": fn}):
    # torch's time over the faster is the most any fusion around those GEMMs could gain.
    floors: dict[str, Callable[[], object]] | None = None


def _dtypes(dev):
    return (torch.float32, torch.bfloat16) if dev.type == "cpu" else (torch.bfloat16, torch.float16)


def gemm_cases(dev):
    shapes = [(64, 512, 256)] if dev.type == "cpu" else [(2048, 14336, 4096)]
    for m, n, k in shapes:
        for dtype in _dtypes(dev):
            x = torch.randn(m, k, device=dev).to(dtype)
            w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
            bias = torch.randn(n, device=dev).to(dtype)
            plan = kp.GemmPlan.select(
                kp.GemmDescriptor(m, n, k, kp.dtypes.dtype_info(dtype).name, epilogue="gelu_bias", transb=True, device=str(dev))
            )
            yield Case(
                f"linear gelu_bias {m}x{k} -> {n}",
                dtype,
                _with_backend(lambda: kp.linear(x, w, bias, "gelu_bias"), plan.sku.backend),
                lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"),
                F.gelu(F.linear(x.double(), w.double(), bias.double()), approximate="tanh"),
                1e-3,
            )


def fp8_cases(dev):
    """fp8 rowwise linear (operands quantized beforehand) against bf16 ``F.linear`` on the same data.

    The oracle is the fp64 product of the dequantized operands, so ``err`` is
    the GEMM's own error; the torch column's error against it is fp8's
    quantisation error, by construction.
    """
    shapes = [(64, 256, 512)] if dev.type == "cpu" else [(8192, 8192, 8192), (2048, 14336, 4096), (8192, 28672, 8192)]
    for m, n, k in shapes:
        x = torch.randn(m, k, device=dev).bfloat16()
        w = (torch.randn(n, k, device=dev) / k**0.5).bfloat16()
        xq, wq = kp.fp8.quantize(x, "rowwise"), kp.fp8.quantize(w, "rowwise")
        desc = kp.GemmDescriptor(m, n, k, "e4m3", out_dtype="bf16", transb=True, scale_a="vector",
                                 scale_b="vector", device=str(dev))
        yield Case(
            f"fp8 rowwise {m}x{k} -> {n}",
            torch.bfloat16,
            _with_backend(lambda: kp.fp8.linear(xq, wq), kp.GemmPlan.select(desc).sku.backend),
            lambda: F.linear(x, w),
            xq.dequantize(torch.float64) @ wq.dequantize(torch.float64).T,
            8e-3,
        )


def fused_linear_cases(dev):
    """One training step's gradients, FusedLinear against ``act(F.linear)`` with autograd; the output is dx."""
    shapes = [(64, 256, 128)] if dev.type == "cpu" else [(8192, 28672, 8192), (2048, 14336, 4096)]
    for (m, n, k), activation in ((s, a) for s in shapes for a in ("gelu", "relu")):
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        layer = kp.nn.FusedLinear(k, n, activation=activation, device=dev, dtype=dtype)
        w, b = layer.weight, layer.bias
        x = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=dtype)
        act = (lambda z: F.gelu(z, approximate="tanh")) if activation == "gelu" else F.relu

        def step(fn):
            return lambda: torch.autograd.grad(fn(x), (x, w, b), dy)[0]

        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
        oracle = torch.autograd.grad(act(F.linear(x64, w64, b64)), x64, dy.double())[0]
        plan = kp.GemmPlan.select(kp.GemmDescriptor(m, n, k, kp.dtypes.dtype_info(dtype).name,
                                                    epilogue=f"{activation}_aux_bias", transb=True, device=str(dev)))
        xd = x.detach()
        dz = dy.clone()  # stands in for act'(z) * dy: the GEMMs' times do not depend on the values

        # The step's three products, y = x W^T + b, dx = dz W and dW = dz^T x, with no epilogue
        # and no elementwise pass: as torch's eager step runs them, and as kernelplan's tuned plans.
        @torch.no_grad()
        def torch_gemms():
            return F.linear(xd, w, b), torch.mm(dz, w), torch.mm(dz.t(), xd)

        @torch.no_grad()
        def kp_gemms():
            return kp.linear(xd, w, b), kp.linear(dz, w.t()), kp.linear(dz.t(), xd.t())

        yield Case(
            f"FusedLinear {activation} step {m}x{k}->{n}",
            dtype,
            _with_backend(step(layer), plan.sku.backend),
            step(lambda t: act(F.linear(t, w, b))),
            oracle,
            1e-3 if dtype == torch.float32 else 1.6e-2,
            floors={"torch": torch_gemms, "kp": kp_gemms},
        )


def _with_backend(fn, backend):
    """First call returns (output, backend) for the report; later calls (timing) just run."""
    state = {"first": True}

    def run():
        if state["first"]:
            state["first"] = False
            return fn(), backend
        return fn()

    return run


def all_gemm_cases(dev):
    yield from gemm_cases(dev)
    yield from fp8_cases(dev)
    yield from fused_linear_cases(dev)


SUITES: dict[str, Callable] = {"gemm": all_gemm_cases}  # "sparse24" and "gated" have their own runners
