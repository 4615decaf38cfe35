"""Bespoke Triton kernels.  Importing this package does not import Triton.

Each kernel module imports ``triton`` at its top and is itself imported
lazily, from a backend's ``run``; ``triton_reason`` answers a backend's
``supports`` without importing anything heavy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def have_triton() -> bool:
    """Whether Triton is installed (asked on host paths: looked up once)."""
    return importlib.util.find_spec("triton") is not None


def triton_reason(device: str) -> str | None:
    """Why a Triton backend cannot run on ``device``, or None if it can."""
    if not have_triton():
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

    ``kernel[grid](*args)`` binds its arguments, builds launch metadata and
    reads the launch hooks on every call; its C launcher then parses every
    argument again.  A ``Compiled`` launches with one driver call
    (``direct.DirectLaunch``: 5.5-6.6 us of host time per launch on an H100's
    host, where ``kernel.run`` took 7.2 and ``kernel[grid]`` more).  Pointer
    arguments are passed as ints: the caller vouches that they are device
    pointers of the dtype and alignment the kernel was compiled for.

    ``route`` says how it launches: ``"cuLaunchKernel"``, or Triton's launcher
    with the reason (``direct.why_not_direct``: no cuda-bindings, launch
    attributes, Triton scratch).  With a launch hook set (a profiler),
    launches go through ``kernel[grid]`` so that the hook sees them.  (Triton
    3.6 keeps an empty hook chain where no hook is set.)
    """

    __slots__ = ("kernel", "constexpr_values", "route", "_direct")

    def __init__(self, kernel, constexpr_values: tuple, n_args: int):
        from .direct import DirectLaunch, why_not_direct

        if not _RUNTIME_KNOBS:
            import triton.knobs

            _RUNTIME_KNOBS.append(triton.knobs.runtime)
        self.kernel = kernel
        self.constexpr_values = constexpr_values  # passed after the arguments, as Triton's launcher expects
        why = why_not_direct(kernel)
        self._direct = DirectLaunch(kernel, n_args) if why is None else None
        self.route = "cuLaunchKernel" if why is None else f"triton's launcher: {why}"

    def __call__(self, grid: tuple, args: tuple, stream: int) -> None:
        hooks = _RUNTIME_KNOBS[0]
        enter, exit_ = hooks.launch_enter_hook, hooks.launch_exit_hook
        if (enter is None or not getattr(enter, "calls", True)) and (exit_ is None or not getattr(exit_, "calls", True)):
            if self._direct is not None:
                self._direct(grid, args, stream)
                return
            k = self.kernel
            k.run(*grid, stream, k.function, k.packed_metadata, None, None, None, *args, *self.constexpr_values)
        else:  # a hook is set (Triton 3.6 and later hold an empty chain where none is)
            self.kernel[grid](*args, *self.constexpr_values, stream=stream)


_RUNTIME_KNOBS: list = []  # [triton.knobs.runtime], filled by the first Compiled: read per launch, cheaply


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
        # Triton reads TRITON_INTERPRET when ``@triton.jit`` runs: the kernel object itself says.
        self.interpreted = type(fn).__name__ == "InterpretedFunction"
        self._compiled: dict = {}
        self._constexpr_names: dict[int, list[str]] = {}  # by the number of positional args
        # Arguments the kernel's ``do_not_specialize`` names: one compiled kernel for every value of them.
        self._plain = tuple(p.do_not_specialize for p in getattr(fn, "params", ()))

    def compiled(self, args: tuple, constexprs: dict, **options) -> Compiled:
        """The kernel compiled for these arguments' specialization (compiled now if new, not launched)."""
        names = self._constexpr_names.get(len(args))
        if names is None:
            names = self._constexpr_names[len(args)] = self.fn.arg_names[len(args):]
        values = tuple(constexprs[name] for name in names)  # the kernel's parameter order
        # A compiled kernel is loaded into one device's context: the device is part of the key.
        device = args[0].get_device()
        plain = self._plain
        key = (device, values, tuple(options.items()),
               tuple(None if i < len(plain) and plain[i] else _specialization(a) for i, a in enumerate(args)))
        hit = self._compiled.get(key)
        if hit is None:
            from .triton_cache import compiling

            with on_device(device), compiling():  # Triton compiles and loads for the current device
                kernel = self.fn.warmup(*args, grid=(1,), **constexprs, **options)
                hit = self._compiled[key] = Compiled(kernel, values, len(args))
        return hit

    def __call__(self, grid, args: tuple, constexprs: dict, **options) -> None:
        if self.interpreted:
            self.fn[grid](*args, **constexprs, **options)
            return
        # A compiled kernel's launcher reads all three grid dimensions; pointers go as ints.
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        device = args[0].get_device()
        with on_device(device):
            self.compiled(args, constexprs, **options)((*grid, 1, 1)[:3], ints, raw_stream(device))


def raw_stream(index: int) -> int:
    """The caller's current stream on device ``index``, as a ``cudaStream_t``.

    Through the accessor Triton's launcher uses where this torch has it: the public
    ``torch.cuda.current_stream(index).cuda_stream`` builds a Stream object, about 4 µs
    of host time per call on an H200 host, a sixth of a small GEMM's.
    """
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def on_device(index: int | None):
    """A context in which CUDA device ``index`` is current: a no-op one where it already is.

    ``index`` None (a bare "cuda": the current device) or negative (a CPU tensor's
    ``get_device()``) changes nothing.

    Triton, cuBLASLt and cuSPARSELt launch into the current device's context and
    Triton compiles for the current device, where torch's own ops guard the
    device of their tensors.  Without this, a tensor on cuda:1 while cuda:0 is
    current is a launch error, or a kernel loaded for the other device.
    """
    if index is None or index < 0 or torch._C._cuda_getDevice() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def current_device() -> int:
    """The index of the current CUDA device (``torch.cuda.current_device`` without its wrapper)."""
    return torch._C._cuda_getDevice()


def stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` without its Python wrapper (asked per call on host paths)."""
    return torch._C._cuda_isCurrentStreamCapturing()
