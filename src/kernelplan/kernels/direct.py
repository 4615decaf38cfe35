"""Launching a compiled Triton kernel with one driver call: ``cuLaunchKernel`` through cuda-bindings.

Triton's launcher costs host time a small GEMM cannot hide.  Measured on an
H100's host with the 2:4 kernel (13 runtime arguments), host time alone, the
GPU never waited on:

============================================  =======
route                                         us/call
============================================  =======
``kernel.run`` (Triton's Python, then its C)     7.2
Triton's C launcher called directly              5.7
``cuLaunchKernel`` through cuda-bindings         5.5
the same, arguments packed by ``struct``         6.6
============================================  =======

Triton's C launcher is generated per signature and its argument list differs
between releases (38 positional arguments for this kernel on 3.6, a generic
form on 3.9), so it is not called from here; cuda-bindings' ``cuLaunchKernel``
is one public call on every release.

Which parameters the compiled function takes is read from the function itself
(``cuFuncGetParamInfo``) and matched against Triton's signature: the
arguments not specialized away, in order, then the scratch pointers Triton
appends (null here: ``direct_launch`` refuses kernels that use scratch).
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
import threading

from ..errors import KernelPlanError

# Each parameter gets an 8-byte slot (a tensor map, 128 opaque bytes, its own 128); the driver copies the
# parameter's own size from its slot's start.
_SLOT = {
    "i8": "b7x", "i16": "h6x", "i32": "i4x", "i64": "q",
    "u8": "B7x", "u16": "H6x", "u32": "I4x", "u64": "Q",
    "fp32": "f4x", "fp64": "d", "tensormap": "128s",
}
_SIZE = {"i8": 1, "i16": 2, "i32": 4, "i64": 8, "u8": 1, "u16": 2, "u32": 4, "u64": 8, "fp32": 4, "fp64": 8,
         "tensormap": 128}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _slot_code(ty: str) -> tuple[str, int] | None:
    """The struct code of a parameter of Triton type ``ty`` and its size, or None if not packable here."""
    if ty.startswith("*"):
        return "Q", 8
    if ty in _SLOT:
        return _SLOT[ty], _SIZE[ty]
    return None


def why_not_direct(kernel) -> str | None:
    """Why ``kernel`` must go through Triton's launcher, or None if ``DirectLaunch`` can launch it."""
    md = kernel.metadata
    if _driver() is None:
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or \
            getattr(md, "launch_pdl", False):
        return "the kernel launches with clusters, a cooperative grid or PDL (launch attributes)"
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return "the kernel uses Triton's global or profile scratch"
    types = [t for t in kernel.src.signature.values() if t != "constexpr"]
    bad = [t for t in types if _slot_code(t) is None]
    if bad:
        return f"argument types {sorted(set(bad))} are not packed here"
    return None


class FunctionLaunch:
    """``cuLaunchKernel`` of one loaded function whose parameters are given as Triton type names.

    Arguments are Python ints and floats, pointers as ints, tensor maps as
    their 128 bytes.  Each thread packs
    them into a buffer of its own: the driver copies a launch's parameters
    before the call returns.  ``extra`` 8-byte null parameters follow them.
    """

    __slots__ = ("name", "function", "block", "shared", "pick", "pack", "size", "pdl", "_codes", "_offsets", "_local",
                 "_cu")

    def __init__(self, function, name: str, types: list[str], block: int, shared: int, extra: int = 0,
                 pick=None, pdl: bool = False):
        codes = [_slot_code(ty) for ty in types]
        if None in codes:
            raise KernelPlanError(f"kernel {name}: parameter types {types} include one not packed here")
        self.name, self.function, self.block, self.shared = name, function, block, shared
        self.pdl = pdl  # launched with programmatic stream serialization (_launch_pdl)
        self.pick = pick or (lambda args: args)
        self._codes = [code for code, _ in codes]
        layout = struct.Struct("<" + "".join(self._codes) + "8x" * extra)
        self.pack = layout.pack_into
        self.size = layout.size
        slots = [struct.calcsize("<" + code) for code, _ in codes] + [8] * extra
        self._offsets = [sum(slots[:i]) for i in range(len(slots))] or [0]
        self._local = threading.local()
        self._cu = _driver()

    def _buffers(self):
        self._local.buffers = buffers = _param_buffers(bytes(max(self.size, 8)), self._offsets)
        return buffers

    def __call__(self, grid: tuple, args: tuple, stream: int, packed: bool = False) -> None:
        """Launch on ``grid`` with ``args`` (the parameters themselves where ``packed``, else through ``pick``)."""
        buffers = getattr(self._local, "buffers", None) or self._buffers()
        self.pack(buffers[0], 0, *(args if packed else self.pick(args)))
        if self.pdl:
            err = _launch_pdl(self._cu, self.function, grid, self.block, self.shared, stream, buffers[2])
        else:
            err, = self._cu.cuLaunchKernel(self.function, grid[0], grid[1], grid[2], self.block, 1, 1, self.shared,
                                           _stream(self._cu, stream), buffers[2], 0)
        if err:
            _launch_failed(self, grid, err)

    def launch_params(self, grid: tuple, args: tuple):
        """``(grid, parameters, x_map)`` of ``self(grid, args, stream)``, for ``bind``; None where a call does more
        than pack its parameters and launch.  ``x_map`` (None: x's address is its parameter) gives x's parameter
        from x's address."""
        return grid, self.pick(args), None

    def bind(self, grid: tuple, args: tuple) -> "BoundLaunch | None":
        """``self(grid, args, stream)`` with its parameters packed once, but for the 2:4 kernels' x, bias and y
        (``BoundLaunch``); None where ``launch_params`` is."""
        made = self.launch_params(grid, args)
        return None if made is None else BoundLaunch(self, *made)


def _param_buffers(template: bytes, offsets: list[int]) -> tuple:
    """A thread's parameter buffer, filled from ``template``: (its storage, the pointers to each parameter's slot,
    their address for ``cuLaunchKernel``).  The storage and the pointers live as long as the tuple."""
    storage = ctypes.create_string_buffer(template, len(template))
    base = ctypes.addressof(storage)
    pointers = (ctypes.c_void_p * len(offsets))(*[base + offset for offset in offsets])
    return storage, pointers, ctypes.addressof(pointers)


def _launch_pdl(cu, function, grid: tuple, block: int, shared: int, stream: int, params: int):
    """``cuLaunchKernelEx`` with programmatic stream serialization: the kernel may start before the one before it in
    the stream has completed, once every CTA of that one has let it (``griddepcontrol.launch_dependents``) or left,
    and it must wait (``griddepcontrol.wait``) before it reads what that one wrote.  For kernels built for it alone
    (``sparse24_ws.cu``'s KP_PDL, an experiment: docs/design/0050).  Returns the driver's error."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes, config.hStream = shared, _stream(cu, stream)
    config.attrs, config.numAttrs = _pdl_attributes(cu), 1
    err, = cu.cuLaunchKernelEx(config, function, params, 0)
    return err


@functools.cache
def _pdl_attributes(cu) -> list:
    """The one launch attribute of ``_launch_pdl``, made once per driver module."""
    attribute = cu.CUlaunchAttribute()
    attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    return [attribute]


def _launch_failed(launch, grid, err):
    raise KernelPlanError(
        f"cuLaunchKernel of {launch.name} (grid {grid}, {launch.block} threads, {launch.shared} bytes of "
        f"shared memory) failed: {err.name}; the device is in an error state or the launch does not fit it"
    )


_thread_id = threading.get_ident


class XParams(dict):
    """x's tensor-map parameter by x's address: ``make(address)`` on a miss, at most ``most`` kept (all dropped when
    full).  One table serves every bound launch of a kernel variant and shape of x (``TensorMaps.x_params``)."""

    __slots__ = ("make", "most")

    def __init__(self, make, most: int):
        super().__init__()
        self.make, self.most = make, most

    def __missing__(self, address: int) -> bytes:
        if len(self) >= self.most:
            self.clear()
        made = self[address] = self.make(address)
        return made


class BoundLaunch:
    """One launch of a 2:4 kernel for one weight and one shape of x, its parameters packed once but for x's
    (parameter 0), the bias's and y's (parameters 3 and 4: the kernels' order is x, values, codes, bias, y, ...).
    A call writes those three into its thread's buffer and launches.

    x's parameter is its address, or, with ``x_map``, x's tensor map, kept by x's address (the few buffers an
    eager model's activations cycle through) in ``x_map`` itself where it is an ``XParams`` (a table the launches
    of one kernel and shape of x share), else in a table of this launch's.  On an H100's host, a 768x768 layer's
    bound call (checks, y, launch) went from 18.6 to 15.3 us with it
    (``bench/results/sparse24-host-768-n16-*h100.json``).

    The thread that binds it packs into buffers held here; other threads into their own (a thread-local).  A loop
    over a model's layers reads each one's launch cold, and the host work of a call grew with every object it
    touched per weight (docs/design/0071).
    """

    __slots__ = ("launch", "grid", "_template", "_offsets", "_pack_x", "_pack_by", "_by_at", "_maps",
                 "_owner", "_buffers", "_local", "_cu", "_function", "_block", "_shared", "_pdl")
    MAX_X = 16

    def __init__(self, launch: FunctionLaunch, grid: tuple, params: tuple, x_map=None):
        codes = launch._codes
        if len(codes) < 5 or codes[3:5] != ["Q", "Q"] or codes[0] != ("Q" if x_map is None else "128s"):
            raise KernelPlanError(f"{launch.name}: parameters {codes} are not a 2:4 kernel's (x, values, codes, bias, "
                                  f"y, ...), x {'a pointer' if x_map is None else 'a tensor map'}")
        template = bytearray(max(launch.size, 8))
        launch.pack(template, 0, *params)
        self.launch, self.grid = launch, grid
        self._template, self._offsets = bytes(template), launch._offsets
        self._pack_x = struct.Struct("<" + codes[0]).pack_into
        self._pack_by = struct.Struct("<QQ").pack_into
        self._by_at = launch._offsets[3]
        self._maps = None if x_map is None else x_map if isinstance(x_map, XParams) else XParams(x_map, self.MAX_X)
        self._owner, self._buffers = _thread_id(), _param_buffers(self._template, self._offsets)
        self._local = threading.local()
        self._cu, self._function, self._block, self._shared = launch._cu, launch.function, launch.block, launch.shared
        self._pdl = launch.pdl  # read per call as the fields above are: set on the launch before it is bound

    def __call__(self, x: int, bias: int, y: int, stream: int) -> None:
        buffers = self._with_x(x)
        self._pack_by(buffers[0], self._by_at, bias, y)
        self._launch(buffers, stream)

    def _with_x(self, x: int) -> tuple:
        """This thread's parameter buffers (``_param_buffers``), x's parameter written into them."""
        if _thread_id() == self._owner:
            buffers = self._buffers
        else:
            buffers = getattr(self._local, "buffers", None)
            if buffers is None:
                buffers = self._local.buffers = _param_buffers(self._template, self._offsets)
        self._pack_x(buffers[0], 0, x if self._maps is None else self._maps[x])
        return buffers

    def _launch(self, buffers: tuple, stream: int) -> None:
        grid = self.grid
        if self._pdl:
            err = _launch_pdl(self._cu, self._function, grid, self._block, self._shared, stream, buffers[2])
        else:
            err, = self._cu.cuLaunchKernel(self._function, grid[0], grid[1], grid[2], self._block, 1, 1,
                                           self._shared, _stream(self._cu, stream), buffers[2], 0)
        if err:
            _launch_failed(self.launch, grid, err)


class DirectLaunch(FunctionLaunch):
    """``cuLaunchKernel`` of one compiled Triton kernel.

    The arguments are the kernel's positional ones as Triton took them when it
    compiled (those it specialized to constants are dropped here).
    """

    __slots__ = ()

    def __init__(self, kernel, n_args: int):
        cu = _driver()
        signature = list(kernel.src.signature.values())[:n_args]
        runtime = [i for i, ty in enumerate(signature) if ty != "constexpr"]
        types = [signature[i] for i in runtime]
        name = kernel.metadata.name
        if kernel.function is None:
            # Triton loads a compiled module onto the device at its first launch, with this; it also
            # raises the function's dynamic shared memory limit to what the kernel uses.
            kernel._init_handles()
        function = cu.CUfunction(kernel.function)
        sizes = _param_sizes(cu, function)
        extra = sizes[len(runtime):]
        # The function's parameters must be the runtime arguments, then Triton's null scratch pointers:
        # anything else means this Triton passes its kernels arguments in a way not known here.
        if [_slot_code(ty)[1] for ty in types] != sizes[:len(runtime)] or any(size != 8 for size in extra):
            raise KernelPlanError(
                f"kernel {name}: its compiled parameters have sizes {sizes}, where the Triton signature "
                f"{signature} gives {[_slot_code(ty)[1] for ty in types]} and 8-byte scratch pointers; launch "
                f"it through Triton (kernelplan.kernels.Compiled with direct=False) and report the Triton version"
            )
        pick = operator.itemgetter(*runtime) if len(runtime) > 1 else (lambda args: (args[runtime[0]],))
        super().__init__(function, name, types, 32 * kernel.metadata.num_warps, kernel.metadata.shared,
                         extra=len(extra), pick=pick)

    def launch_params(self, grid: tuple, args: tuple):
        return None  # a Triton kernel's parameters are in its own order, not the 2:4 kernels'


def _param_sizes(cu, function) -> list[int]:
    """The byte size of each parameter of a compiled function, in order."""
    sizes = []
    while True:
        err, _offset, size = cu.cuFuncGetParamInfo(function, len(sizes))
        if err:  # CUDA_ERROR_INVALID_VALUE past the last parameter
            return sizes
        sizes.append(size)


_STREAMS: dict = {}  # raw handle -> CUstream: building one per call costs host time


def _stream(cu, raw: int):
    stream = _STREAMS.get(raw)
    if stream is None:
        if len(_STREAMS) >= 256:
            _STREAMS.clear()
        stream = _STREAMS[raw] = cu.CUstream(raw)
    return stream
