"""Bespoke Triton kernels.  Importing this package does not import Triton.

Each kernel module imports ``triton`` at its top and is itself imported
lazily, from a backend's ``run``; ``triton_reason`` answers a backend's
``supports`` without importing anything heavy.
"""

from __future__ import annotations

import functools
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


class Compiled:
    """One compiled kernel, launched without Triton's per-call Python.

    ``kernel[grid](*args)`` builds a closure and reads the launch hooks, and
    its C launcher calls ``data_ptr()`` and checks each tensor's pointer with
    the driver: about 5 us of host time per launch on an H200's host, where a
    launch given the pointers as ints takes 4 us (measured with a 2:4 kernel of
    15 arguments).  Pointer arguments may be passed as ints, which the launcher
    takes as they are: the caller vouches that they are device pointers of the
    right dtype and alignment (the specialization the kernel was compiled for).
    With a launch hook set (a profiler), launches go through ``kernel[grid]``
    so that the hook sees them.  (Triton 3.6 keeps an empty hook chain where
    no hook is set; before ``_unhooked`` knew that, every launch on the GPU
    machines took ``kernel[grid]``, whose runner and launch metadata showed in
    a profile of 2:4 calls on an H200's host.)
    """

    __slots__ = ("kernel", "constexpr_values")

    def __init__(self, kernel, constexpr_values: tuple):
        self.kernel = kernel
        self.constexpr_values = constexpr_values  # passed after the arguments, as the launcher expects

    def __call__(self, grid: tuple, args: tuple, stream: int) -> None:
        k = self.kernel
        hooks = _knobs().runtime
        if _unhooked(hooks.launch_enter_hook) and _unhooked(hooks.launch_exit_hook):
            k.run(*grid, stream, k.function, k.packed_metadata, None, None, None, *args, *self.constexpr_values)
        else:
            k[grid](*args, *self.constexpr_values, stream=stream)


def _unhooked(hook) -> bool:
    """No launch hook is set: Triton 3.6 and later hold an always-present chain, empty when none is."""
    return hook is None or not getattr(hook, "calls", True)


@functools.lru_cache(maxsize=1)
def _knobs():
    import triton.knobs

    return triton.knobs


class Launcher:
    """``fn[grid](*args, **constexprs)`` without Triton's per-call re-binding.

    A JIT launch binds and re-specializes every argument on every call: about
    20 us of host time per launch on an H200's host, as long as the kernel of
    a small 2:4 GEMM.  This keeps each compiled kernel under the properties
    Triton specializes on (the constexprs and options, each pointer's dtype and
    16-byte alignment, each integer's == 1, % 16 and 32-bit range) and launches
    it through ``Compiled``.  Under the interpreter every launch goes through
    ``fn[grid]``.
    """

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._constexpr_names: dict[int, list[str]] = {}  # by the number of positional args

    def compiled(self, args: tuple, constexprs: dict, **options) -> Compiled:
        """The kernel compiled for these arguments' specialization (compiled now if new, not launched)."""
        names = self._constexpr_names.get(len(args))
        if names is None:
            names = self._constexpr_names[len(args)] = self.fn.arg_names[len(args):]
        values = tuple(constexprs[name] for name in names)  # the kernel's parameter order
        key = (values, tuple(options.items()), tuple(_specialization(a) for a in args))
        hit = self._compiled.get(key)
        if hit is None:
            kernel = self.fn.warmup(*args, grid=(1,), **constexprs, **options)
            hit = self._compiled[key] = Compiled(kernel, values)
        return hit

    def __call__(self, grid, args: tuple, constexprs: dict, **options) -> None:
        if interpreting():
            self.fn[grid](*args, **constexprs, **options)
            return
        # A compiled kernel's launcher reads all three grid dimensions.
        self.compiled(args, constexprs, **options)((*grid, 1, 1)[:3], args, current_stream(args[0].device))


def current_stream(device: torch.device) -> int:
    """The raw handle of the caller's current CUDA stream on ``device``."""
    return torch._C._cuda_getCurrentRawStream(device.index)
