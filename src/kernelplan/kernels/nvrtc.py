"""CUDA C++ kernels: compiled at run time by NVRTC and loaded per device, through cuda-bindings.

NVRTC ships with the CUDA wheels torch depends on (``nvidia-cuda-nvrtc``);
cuda-bindings finds it through cuda-pathfinder.  A compile takes a fraction
of a second; its cubin is kept on disk (``kernel_cache.py``) and per process,
and a loaded function is cached per device.  Launches go through
``direct.FunctionLaunch``, one ``cuLaunchKernel`` each.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

import torch

from ..errors import KernelPlanError
from . import on_device


def nvrtc_reason(device: str) -> str | None:
    """Why NVRTC kernels cannot run on ``device``, or None if they can (nothing is loaded to answer)."""
    if torch.device(device).type != "cuda":
        return f"device {device}: CUDA C++ kernels run on CUDA devices"
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed: pip install cuda-bindings"
    return None


CUDA_DIR = Path(__file__).resolve().parent / "cuda"  # the .cu/.cuh sources, shipped as package data
DUMP_ENV = "KERNELPLAN_DUMP_CUDA"  # a folder: each compiled kernel's full source and PTX are written there


@functools.lru_cache(maxsize=64)
def cuda_source(name: str, first: Path | None = None) -> str:
    """The text of ``kernels/cuda/<name>`` with its local ``#include "..."`` files inlined (NVRTC gets one string).
    A file in the folder ``first`` (a bench's own sources) is taken before one of ``kernels/cuda``."""
    folder = first if first is not None and (first / name).exists() else CUDA_DIR
    text = (folder / name).read_text()
    text = re.sub(r'^#include "([^"]+)"\s*$', lambda m: cuda_source(m.group(1), first), text, flags=re.M)
    return re.sub(r"^#pragma once\s*$", "", text, flags=re.M)


def arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


# -lineinfo: profilers and compute-sanitizer map SASS back to the .cu lines.
OPTIONS = ("-std=c++17", "-lineinfo")
COMPILES = [0]  # NVRTC compiles in this process: a warm disk cache keeps it at 0


@functools.lru_cache(maxsize=256)
def cubin(source: str, architecture: str) -> bytes:
    """The compiled ``source`` for ``architecture`` (``sm_90``), from the disk cache or NVRTC; the log on failure."""
    from cuda.bindings import nvrtc

    from ..cache import driver_version
    from .kernel_cache import cache_key, kernel_cache

    cache = kernel_cache()
    key = cache_key(source, OPTIONS, architecture, f"{_nvrtc_version(nvrtc)}, driver {driver_version()}")
    binary = None if os.environ.get(DUMP_ENV) else cache.get(key)  # a dump asks for the compile itself
    if binary is None:
        binary = _compile(nvrtc, source, architecture)
        cache.put(key, binary)
    return binary


@functools.lru_cache(maxsize=1)
def _nvrtc_version(nvrtc) -> str:
    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


def _compile(nvrtc, source: str, architecture: str) -> bytes:
    COMPILES[0] += 1

    def check(result, what: str, prog=None):
        err = result[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = ""
            if prog is not None:
                _, size = nvrtc.nvrtcGetProgramLogSize(prog)
                buf = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, buf)
                log = buf.decode(errors="replace").strip()
            raise KernelPlanError(f"NVRTC {what} failed ({err.name}) for {architecture}:\n{log}")
        return result[1:]

    prog, = check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernelplan.cu", 0, [], []), "program creation")
    try:
        options = [f"--gpu-architecture={architecture}".encode(), *(o.encode() for o in OPTIONS)]
        check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "compile", prog)
        if os.environ.get(DUMP_ENV):
            _dump(nvrtc, prog, source, architecture)
        size, = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        binary = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, binary), "cubin")
        return binary
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _dump(nvrtc, prog, source: str, architecture: str) -> None:
    """Writes the compiled source and its PTX under $KERNELPLAN_DUMP_CUDA, for a kernel engineer; never fails the compile."""
    import hashlib

    from .._checks import warn

    try:
        folder = Path(os.environ[DUMP_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"{hashlib.sha256(source.encode()).hexdigest()[:12]}-{architecture}"
        stem.with_suffix(".cu").write_text(source)
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
        stem.with_suffix(".ptx").write_bytes(ptx.rstrip(b"\0 "))
    except OSError as e:
        warn(f"{DUMP_ENV}: could not write the kernel dump ({e})", RuntimeWarning, stacklevel=3)


def device_attribute(device_index: int, name: str) -> int:
    """The driver's ``CU_DEVICE_ATTRIBUTE_<name>`` of CUDA device ``device_index``."""
    from cuda.bindings import driver as cu

    torch.cuda.init()
    err, dev = cu.cuDeviceGet(device_index)
    if not err:
        err, value = cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}"), dev)
    if err:
        raise KernelPlanError(f"cannot read cuda:{device_index}'s {name.lower()}: {err.name}")
    return value


@functools.lru_cache(maxsize=None)
def shared_per_block(device_index: int) -> int:
    """The most shared memory a CTA may opt in to on CUDA device ``device_index``, in bytes: 227 KiB on Hopper,
    163 KiB on the A100, 99 KiB on Ada."""
    return device_attribute(device_index, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


@functools.lru_cache(maxsize=256)
def function(source: str, name: str, device_index: int, architecture: str | None = None):
    """The kernel ``name`` of ``source``, compiled for and loaded onto CUDA device ``device_index``."""
    from cuda.bindings import driver as cu

    binary = cubin(source, architecture or arch(device_index))
    with on_device(device_index):
        torch.cuda.init()
        # torch's runtime makes the device's primary context current lazily; the module must load into it.
        err, ctx = cu.cuCtxGetCurrent()
        if err or not int(ctx):
            _, dev = cu.cuDeviceGet(device_index)
            err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
            if not err:
                err, = cu.cuCtxSetCurrent(ctx)
        if err:
            raise KernelPlanError(f"no CUDA context for device {device_index}: {err.name}")
        err, module = cu.cuModuleLoadData(binary)
        if err:
            raise KernelPlanError(f"loading {name} onto cuda:{device_index} failed: {err.name}")
        err, fn = cu.cuModuleGetFunction(module, name.encode())
        if err:
            raise KernelPlanError(f"{name} is not in its compiled module: {err.name}")
    return fn


_PARAMS = ["*u16", "*i32", "*i32", "*u16", "*u16", "i32", "i32", "i32", "i32", "i32"]


def launch(source: str, name: str, device_index: int, label: str, block: int, shared: int = 0,
           architecture: str | None = None):
    """A ``FunctionLaunch`` of kernel ``name`` with the 2:4 kernels' parameters ``(x, values, codes, bias, y, N, M, K,
    x row stride, y row stride)``; ``shared`` bytes of dynamic shared memory, the function's limit raised to it."""
    from cuda.bindings import driver as cu

    from .direct import FunctionLaunch

    fn = function(source, name, device_index, architecture)
    if shared > 48 * 1024:  # above 48 KiB a function must opt in
        err, = cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     shared)
        if err:
            raise KernelPlanError(f"{name} ({label}) cannot have {shared} bytes of shared memory on "
                                  f"cuda:{device_index}: {err.name}")
    return FunctionLaunch(fn, f"{name} {label}", _PARAMS, block, shared)
