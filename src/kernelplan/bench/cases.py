"""The cases ``kernelplan bench`` runs: small shapes on CPU, model shapes on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.plan import memoised_select
from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan


@dataclass
class Case:
    name: str
    dtype: torch.dtype
    run_kp: Callable[[], tuple]  # returns (output, backend name) on the first call, output after
    run_torch: Callable[[], torch.Tensor]
    oracle: torch.Tensor  # fp64
    atol: float


def _dtypes(dev):
    return (torch.float32, torch.bfloat16) if dev.type == "cpu" else (torch.bfloat16, torch.float16)


def sparse24_cases(dev):
    shapes = [(16, 256, 512), (128, 512, 512)] if dev.type == "cpu" else [(16, 8192, 8192), (4096, 8192, 8192)]
    for n, m, k in shapes:
        for dtype in _dtypes(dev):
            gen = torch.Generator(device="cpu").manual_seed(n + m + k)
            w = kp.sparse24.prune(torch.randn(m, k, generator=gen)).to(dev, dtype)
            x = torch.randn(n, k, generator=gen).to(dev, dtype)
            w24 = kp.sparse24.compress(w)
            backend = memoised_select(
                GemmSparse24Plan, GemmSparse24Descriptor(n, m, k, kp.dtypes.dtype_info(dtype).name, device=str(dev))
            ).sku.backend
            yield Case(
                f"linear n={n} {m}x{k}",
                dtype,
                _with_backend(lambda: kp.sparse24.linear(x, w24), backend),
                lambda: F.linear(x, w),
                x.double() @ w.double().T,
                1e-3,
            )


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


def _with_backend(fn, backend):
    """First call returns (output, backend) for the report; later calls (timing) just run."""
    state = {"first": True}

    def run():
        if state["first"]:
            state["first"] = False
            return fn(), backend
        return fn()

    return run


SUITES: dict[str, Callable] = {"sparse24": sparse24_cases, "gemm": gemm_cases}  # "gated" has its own runner
