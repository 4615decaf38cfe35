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


def _with_backend(fn, backend):
    """First call returns (output, backend) for the report; later calls (timing) just run."""
    state = {"first": True}

    def run():
        if state["first"]:
            state["first"] = False
            return fn(), backend
        return fn()

    return run


SUITES: dict[str, Callable] = {"gemm": gemm_cases}  # "sparse24" and "gated" have their own runners
