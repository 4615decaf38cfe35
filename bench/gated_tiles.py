"""Sweep the gated kernel's tile shapes on the GPU (the heuristic in ``kernels/gated.py::_tile``).

    PYTHONPATH=src python bench/gated_tiles.py

Prints TB/s per (BLOCK_R, BLOCK_C, num_warps) for a contiguous and a
transposed bf16 SwiGLU and a contiguous GeGLU (the most compute per byte),
forward and backward, beside the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton.testing

import kernelplan as kp
import kernelplan.kernels.gated as kernels

CONTIGUOUS = [(1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (2, 1024, 8), (4, 1024, 8), (2, 2048, 8),
              (4, 2048, 8), (8, 512, 8), (1, 4096, 8), (8, 1024, 8), (16, 256, 4)]
GEGLU = [(4, 512, 4), (2, 512, 4), (1, 1024, 4), (8, 256, 4), (2, 256, 2), (4, 256, 2), (1, 512, 2),
         (8, 512, 8), (4, 1024, 8), (16, 256, 8), (2, 1024, 4), (8, 1024, 16)]
TRANSPOSED = [(64, 64, 4), (64, 64, 8), (32, 128, 4), (128, 32, 4), (64, 128, 8), (128, 64, 8), (32, 32, 4),
              (128, 128, 8)]


def sweep(x, configs, label, kind="swiglu"):
    y = kp.gated_activation(x, kind, gate="first")
    dy, dx = torch.randn_like(y), torch.empty(x.shape, device=x.device, dtype=x.dtype)
    gbytes_f, gbytes_b = 3 * y.numel() * 2 / 1e9, 5 * y.numel() * 2 / 1e9
    original = kernels._tile
    for cfg in configs:
        kernels._tile = lambda layout, cfg=cfg: cfg
        kernels._launch_params.cache_clear()
        fwd = triton.testing.do_bench(lambda: kp.gated_activation(x, kind, gate="first", out=y), return_mode="median")
        bwd = triton.testing.do_bench(
            lambda: kp.gated_activation_backward(dy, x, kind, gate="first", out=dx), return_mode="median")
        print(f"{label:12} {str(cfg):16} fwd {gbytes_f / fwd:5.2f} TB/s  bwd {gbytes_b / bwd:5.2f} TB/s")
    kernels._tile = original
    kernels._launch_params.cache_clear()
    print(f"{label:12} {'heuristic':16} -> {original(kernels.collapse(tuple(y.shape), [x.stride(), y.stride(), y.stride()]))}")


if __name__ == "__main__":
    src = torch.empty(8192 * 28672, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {2 * src.numel() * 2 / 1e9 / ms:.2f} TB/s")
    del src, dst
    x = torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16)
    sweep(x, CONTIGUOUS, "contiguous")
    sweep(x, GEGLU, "geglu", kind="geglu")
    del x
    sweep(torch.randn(28672, 8192, device="cuda", dtype=torch.bfloat16).t(), TRANSPOSED, "transposed")
