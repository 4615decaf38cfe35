"""Bespoke Triton kernels.  Importing this package does not import Triton.

Each kernel module imports ``triton`` at its top and is itself imported
lazily, from a backend's ``run``; ``triton_reason`` answers a backend's
``supports`` without importing anything heavy.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_reason(device: str) -> str | None:
    """Why a Triton backend cannot run on ``device``, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed: pip install 'kernelplan[gpu]'"
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return None
    return f"device {device}: Triton kernels run on CUDA devices (and on CPU only under TRITON_INTERPRET=1)"


def _specialization(arg):
    """What Triton specializes a launch argument on (its 3.x rules), for ``Launcher``'s key."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    return type(arg), arg


class Launcher:
    """``fn[grid](*args, **constexprs)`` without Triton's per-call re-binding.

    A JIT launch binds and re-specializes every argument on every call: about
    20 us of host time per launch on an H200's host, as long as the kernel of
    a small 2:4 GEMM.  This keeps each compiled kernel under the properties
    Triton specializes on (the constexprs and options, each pointer's dtype and
    16-byte alignment, each integer's == 1, % 16 and 32-bit range) and launches
    the compiled kernel itself on the current stream.  The first launch of a
    key, and every launch under the interpreter, goes through ``fn[grid]``.
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._constexpr_names: dict[int, list[str]] = {}  # by the number of positional args

    def __call__(self, grid, args: tuple, constexprs: dict, **options) -> None:
        if interpreting():
            self.fn[grid](*args, **constexprs, **options)
            return
        names = self._constexpr_names.get(len(args))
        if names is None:
            names = self._constexpr_names[len(args)] = self.fn.arg_names[len(args):]
        values = tuple(constexprs[name] for name in names)  # the kernel's parameter order
        key = (values, tuple(options.items()), tuple(_specialization(a) for a in args))
        kernel = self._compiled.get(key)
        if kernel is None:
            self._compiled[key] = self.fn[grid](*args, **constexprs, **options)
            return
        device = args[0].device.index
        # A compiled kernel's launcher reads all three grid dimensions.
        kernel[(*grid, 1, 1)[:3]](*args, *values, stream=torch._C._cuda_getCurrentRawStream(device))
