"""CUDA C++ 2:4 linear for N <= 16: every operand straight from global memory into MMA registers.  The kernel is
``cuda/sparse24_mma.cu``.

The Triton kernel (``sparse24.py``) expands each compressed tile in a blocked
register layout, and Triton moves the dense tile into the tensor cores'
operand layout through shared memory (a store and an ``ldmatrix`` per dense
element, behind barriers), after the values' own trip through it by
cp.async.  At n <= 16 it levelled off at 2.9-3.0 TB/s of compressed bytes on
an H200 (1.31-1.42x of dense).

Here nothing goes through shared memory but the final sum of K slices:

* The order of K inside a product is free.  ``mma.m16n8k16`` gives lane
  ``t = lane % 4`` the K columns ``{2t, 2t+1, 2t+8, 2t+9}`` of A and of B, so
  those four are made one 2:4 group, positions 0-3, for W and x alike.  A
  lane expands whole groups of its own two rows (the PRMT expansion of the
  Triton kernel, ``_expand_ptx``) straight into its A fragment, and its B
  fragment is four consecutive elements of x.  N tiles are 8 wide.
* Each lane takes four consecutive groups per 64-column step, and the values
  and codes are stored tiled in the order the warp reads them
  (``tiled_values``, ``tiled_codes``: a copy kept with the weight), so a warp
  step reads two runs of 512 bytes and two of 64, and a warp's steps follow
  each other in memory.

Measured on an H200 (bf16, one run, against dense ``F.linear``; the Triton
kernel at its heuristic tiles): with the weight in its row-major layout,
n = 1 1.43-1.54x (Triton 1.32-1.42x) on the 8B and 70B shapes; tiled, n = 1
1.59-1.79x and n = 16 1.52-1.69x, the 128256x4096 LM head at 3.9 TB/s.
Deeper register rings (6, 8 steps), 32-row CTAs and an L2 256-byte prefetch
hint did not pay.

A CTA is ``warps`` warps over the same 16 weight rows, each warp one slice of
K; the slices are summed through shared memory in warp order
(deterministic), then bias and activation are applied and y is written.

``TiledKernel``, ``MmaLinear`` and the per-weight launches here also serve
``cuda_sp`` (``sparse24_sp.py``), whose kernel takes the same arguments.
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass

import torch

from ..dtypes import dtype_info
from ..errors import KernelPlanError
from ..sparse24.format import derived_from, output_rows
from ..sparse24.layout import layout_of, weight_shape
from . import current_device, on_device, raw_stream
from .nvrtc import cuda_source
from ..activations import ACTIVATION_CODES, epilogue_columns, kernel_epilogue
from .sparse24 import _expand_ptx, code_metadata, sm_count

MAX_N = 16  # two 8-wide N tiles
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every _TiledWeight, for drop_launches


@dataclass(frozen=True)
class MmaConfig:
    n_tiles: int  # 8-wide N tiles: N <= 8 * n_tiles
    warps: int  # K slices per CTA
    stages: int = 4  # 64-column steps in the register ring
    min_blocks: int = 1  # CTAs per SM the registers must allow (__launch_bounds__)


def mma_config(n: int, m: int, k: int, sm_count: int) -> MmaConfig:
    """The fewest K slices that make about 15 warps per SM (H200 sweep: 4 at 8192 rows and up, 8 at 4096, 16 at 1024).

    The registers must let 16 warps share an SM.  Two N tiles hold twice the
    x in the ring, so they keep two steps of it, not four: on an H200 (bf16,
    n = 12 and 16, 70B shapes and 4096^2) 1.55-1.65x of dense, where four
    steps at whatever registers ptxas chose ranged from 1.16x to 1.62x.
    """
    warps = next((w for w in (4, 8, 16) if -(-m // 16) * w >= 15 * sm_count), 16)
    while (k // 64) % warps:
        warps //= 2
    n_tiles = 1 if n <= 8 else 2
    return MmaConfig(n_tiles, warps, stages=4 if n_tiles == 1 else 2, min_blocks=max(1, 16 // warps))


def _asm(ptx: str) -> str:
    """Triton's ``$i`` operands as CUDA inline asm's ``%i``: one line of C string literals, one a PTX line."""
    body = re.sub(r"\$(\d+)", r"%\1", ptx)
    return " ".join('"' + line + '\\n"' for line in body.splitlines())


COMMON_SOURCE = cuda_source("common.cuh")


def defines(dtype: str, has_bias: bool, activation: str | None, **sizes: int) -> str:
    """The ``#define`` lines of one kernel variant: its sizes, dtype, bias and epilogue (the Triton kernels' activation
    codes; a gated epilogue's GATED, ``activations.GATED_EPILOGUES``)."""
    act, gated = kernel_epilogue(activation)
    values = dict(sizes, IS_BF16=int(dtype == "bf16"), HAS_BIAS=int(has_bias), ACT=ACTIVATION_CODES[act],
                  GATED=gated)
    values.update({f"ACT_{name.upper()}": code for name, code in ACTIVATION_CODES.items()})
    return "".join(f"#define {k} {v}\n" for k, v in values.items()) + f'#define DT "{dtype}"\n'


def source(cfg: MmaConfig, dtype: str, has_bias: bool, activation: str | None) -> str:
    """The CUDA C++ of one kernel variant (``kp_sparse24_mma``), compiled by NVRTC."""
    head = defines(dtype, has_bias, activation, NT=cfg.n_tiles, WARPS=cfg.warps, STAGES=cfg.stages,
                   MIN_BLOCKS=cfg.min_blocks)
    head += "#define EXPAND " + _asm(_expand_ptx("shr.b32 t, $3, $4;\nand.b32 t, t, 7;\n")) + "\n"
    return head + COMMON_SOURCE + cuda_source("sparse24_mma.cu")


def tiled_values(pairs: torch.Tensor) -> torch.Tensor:
    """int32 ``[M/16, K/64, 2, 8, 4, 4]`` from the pairs ``[M, K/4]``: each warp step's values in lane order.

    Row ``16 i + 8 h + g``, group ``16 s + 4 t + c`` goes to ``[i, s, h, g, t, c]``
    (lane ``4 g + t``).  M must be a multiple of 16.
    """
    m, g4 = pairs.shape
    return pairs.view(m // 16, 2, 8, g4 // 16, 4, 4).permute(0, 3, 1, 2, 4, 5).contiguous()


def tiled_codes(codes: torch.Tensor) -> torch.Tensor:
    """int32 ``[M/16, K/64, 2, 8, 2]`` from the blocked ``[K/64, M, 2]`` codes: each warp step's words together."""
    kb, m, _ = codes.shape
    return codes.view(kb, m // 16, 2, 8, 2).permute(1, 0, 2, 3, 4).contiguous()


def _tiled(values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as the kernel reads it, its rows padded to a multiple of 16 with zeros (code 0, values 0)."""
    m = values.shape[0]
    pad = -m % 16
    pairs = values.detach().contiguous().view(torch.int32)
    codes = code_metadata(metadata)
    if pad:
        pairs = torch.nn.functional.pad(pairs, (0, 0, 0, pad))
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    return tiled_values(pairs), tiled_codes(codes)


@functools.lru_cache(maxsize=256)
def _launcher(cfg: MmaConfig, dtype: str, has_bias: bool, activation: str | None, device_index: int):
    return launch_of(cfg, source(cfg, dtype, has_bias, activation), device_index, f"{cfg} {dtype}")


def launch_of(cfg: MmaConfig, text: str, device_index: int, label: str):
    """The ``FunctionLaunch`` of ``kp_sparse24_mma`` compiled from ``text`` (``source``'s, or another checkout's:
    bench/sparse24_source_ab.py), with ``cfg``'s block."""
    from . import nvrtc

    return nvrtc.launch(text, "kp_sparse24_mma", device_index, label, block=32 * cfg.warps)


class TiledKernel:
    """One CUDA C++ 2:4 kernel family over a tiled copy of the weight: its layout and its launch per call.

    Both kernels take ``(x, tiled values, tiled codes, bias, y, N, M, K,
    x row stride, y row stride)`` and need x rows 16-byte aligned with unit
    stride along K, and y with unit stride along M.
    """

    name = "cuda_mma"
    layout = "cuda_mma tiled"  # the derived layout's name (Sparse24Weight.derived_bytes)
    architecture = None  # what NVRTC compiles for: None is the device's own (nvrtc.arch)
    max_n = MAX_N
    chunks = False  # whether launch takes more than max_n rows of x, in chunks of max_n

    def tiled(self, values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _tiled(values, metadata)

    def launch_for(self, n: int, m: int, k: int, dtype: str, has_bias: bool, activation: str | None,
                   device: int) -> tuple:
        """``(FunctionLaunch, grid)`` of the variant that runs N = n."""
        cfg = mma_config(n, m, k, sm_count(device))
        return _launcher(cfg, dtype, has_bias, activation, device), (-(-m // 16), 1, 1)

    def compile_for(self, n: int, m: int, k: int, dtype: str, has_bias: bool, activation: str | None,
                    device: int) -> tuple:
        """``(config, compile)`` of the variant ``launch_for`` would load: ``compile()`` gives its cubin, from the
        disk cache or NVRTC, and touches no device (so it may run in threads)."""
        from . import nvrtc

        cfg = self.config(n, m, k, device, activation)
        text = self.source(cfg, dtype, has_bias, activation)
        architecture = self.architecture or nvrtc.arch(device)
        return cfg, functools.partial(nvrtc.cubin, text, architecture)

    def config(self, n, m, k, device, activation=None):
        return mma_config(n, m, k, sm_count(device))

    source = staticmethod(source)


class MmaLinear:
    """``call(x, values, metadata, bias) -> act(x @ W^T + bias)`` for small N: a tiled kernel's bound call.

    The tiled weight is built once per weight state (``derived_from``) and
    kept with it: a second copy of the values (half the dense bytes) and of
    the codes.  x whose rows are not 16-byte aligned is copied first (x is at
    most ``kernel.max_n`` rows).
    """

    __slots__ = ("activation", "kernel", "_key", "_build")

    def __init__(self, activation: str | None, kernel: TiledKernel | None = None):
        self.activation = activation or None
        self.kernel = kernel or TiledKernel()
        self._key = f"{self.kernel.name} launch {self.activation}"
        self._build = functools.partial(_TiledWeight, activation=self.activation, kernel=self.kernel)

    def _weight(self, values, metadata) -> "_TiledWeight":
        return derived_from(values, metadata, self._key, self._build, device_work=False)

    def __call__(self, x, values, metadata, bias) -> torch.Tensor:
        y, x2, y2 = output_rows(x, epilogue_columns(weight_shape(values)[0], self.activation))
        self.launch(x2, values, metadata, bias, y2)
        return y

    def held(self, values, metadata):
        """A call bound to one weight: held in the kernel's own layout (no copy to check), or in another, the
        kernel's layout derived beside it (``derived_from`` checks it current on each call).

        It launches straight from the inference fast path (``sparse24.gemm``):
        one lookup by x's layout, y allocated, one launch.  On an H100 the
        layers above it (this call, ``derived_from``'s state check, ``_TiledWeight``)
        cost 12 us per call beside a 7.7 us launch and F.linear's 25 us in all
        (``bench/sparse24_host.py``).
        """
        if layout_of(values) != self.kernel.layout:
            return self._derived_linear  # the layout derived beside the weight: checked current on every call
        return DirectCall(self, self._weight(values, metadata))

    def _derived_linear(self, x, values, metadata, bias) -> torch.Tensor:
        return self._weight(values, metadata).linear(self, x, values, metadata, bias)

    def bound(self, x, values, metadata, bias, y):
        """``launch(x, values, metadata, bias, y)`` resolved once, for arguments that stay the same tensors: a
        call is then one ``cuLaunchKernel`` (the runtime's worker runs a request again this way).  None where a
        call does more than launch (x or y copied, rows in chunks, nothing to do)."""
        n = x.shape[0]
        if n == 0 or values.numel() == 0 or n > self.kernel.max_n:
            return None
        return self._weight(values, metadata).bound(x, bias, y)

    def launch(self, x, values, metadata, bias, y) -> None:
        if x.shape[0] and values.numel():
            self.launch_on(self._weight(values, metadata), x, bias, y)

    def launch_on(self, weight: "_TiledWeight", x, bias, y) -> None:
        """``launch`` on the weight's tiled layout, already looked up (x has rows; the weight has elements)."""
        n = x.shape[0]
        if n > self.kernel.max_n and not self.kernel.chunks:
            raise KernelPlanError(f"x has {n} rows; the {self.kernel.name} kernel takes at most {self.kernel.max_n}: "
                                  f"dispatch another backend")
        step = self.kernel.max_n
        if n <= step:
            weight(x, bias, y)
            return
        # Past its widest N tile the kernel runs x in chunks of rows, each reading W again: the one layout's
        # path for large n where no wider kernel runs (mma.sp on Ampere and Ada).
        for i in range(0, n, step):
            weight(x[i:i + step], bias, y[i:i + step])


def drop_launches() -> None:
    """Every live weight's prepared launches: its next call looks its kernel and tile up again (after tile tuning,
    ``sparse24/tiles.py``, changed a tile).  Captured CUDA graphs keep what they recorded."""
    _DROPS[0] += 1  # every DirectCall's launch too
    for weight in list(_LIVE):
        weight._calls.clear()
        weight._direct.clear()


_DROPS = [0]  # drop_launches' count: a DirectCall's launch is current while this has not moved


class DirectCall:
    """``call(x, values, metadata, bias) -> y`` on one weight held in the kernel's layout, for one shape of x and
    bias or none (one entry of ``sparse24.gemm``'s fast path, whose key fixes both): ``_TiledWeight.linear``
    with its launch for that shape kept here, so an eager call reaches ``cuLaunchKernel`` without a table lookup.

    Its state is a few fields of one object: a loop over a model's many layers reads each call's state cold, and
    the host work of a call grew with every object it touched per weight (``bench/sparse24_host_weights.py``;
    docs/design/0071).  Calls the kept launch does not fit (x moved to an unaligned or strided copy, another shape,
    the weight's storage replaced, another current device, launches dropped) go through ``_TiledWeight.linear``.
    """

    __slots__ = ("slow", "weight", "kept", "pairs", "codes", "device")

    def __init__(self, slow: MmaLinear, weight: "_TiledWeight"):
        self.slow, self.weight, self.kept = slow, weight, None
        self.pairs, self.codes = weight.weight
        self.device = weight.device

    def __call__(self, x, values, metadata, bias) -> torch.Tensor:
        # One tuple, replaced whole: a thread never reads one shape's launch with another's y.
        kept = self.kept  # (BoundLaunch, y's shape, x's shape, no bias, drop_launches' count)
        x_ptr = x.data_ptr()
        if kept is None or x_ptr & 15 or x.shape != kept[2] or (bias is None) is not kept[3] or \
                not x.is_contiguous() or values.data_ptr() != self.pairs or metadata.data_ptr() != self.codes or \
                current_device() != self.device or kept[4] != _DROPS[0]:
            return self._through_weight(x, values, metadata, bias)
        y = x.new_empty(*kept[1])  # ints: output_rows says why
        kept[0](x_ptr, 0 if bias is None else bias.data_ptr(), y.data_ptr(), raw_stream(self.device))
        return y

    def _through_weight(self, x, values, metadata, bias) -> torch.Tensor:
        drops = _DROPS[0]
        y = self.weight.linear(self.slow, x, values, metadata, bias)
        hit = self.weight._direct.get((x.shape, bias is None))
        if hit is None or values.data_ptr() != self.pairs or metadata.data_ptr() != self.codes:
            self.kept = None
        else:
            self.kept = (hit[0], hit[1], tuple(x.shape), bias is None, drops)
        return y


class _TiledWeight:
    """One weight's tiled layout and its launches; per call only x, bias, y and N vary.

    Each call looks its launch up by the varying arguments' layout (N, strides,
    alignment, bias or not): the host work of a call is then a dictionary
    lookup and one ``cuLaunchKernel``.
    """

    _MAX_KEYS = 256

    def __init__(self, values, metadata, activation, kernel: TiledKernel):
        # Held: the weight's own tensors are the layout (else a copy derived from them, current as its caller checked)
        self.held = layout_of(values) == kernel.layout
        # A held weight is read as it is: nothing to build, so nothing for derived_from to refuse inside a capture.
        # A capture can be the first call on a weight's state: cudagraph trees re-record, in a capture, a graph
        # whose weights moved (a sibling group laying out its buffer after torch.compile, ``.to()``; 0078).
        # Derived layouts are keyed by the layout, not the kernel: kernels that read one layout share one copy of it.
        self.pairs, self.codes = kernel.tiled(values, metadata) if self.held else \
            derived_from(values, metadata, kernel.layout, kernel.tiled)
        self.weight = (self.pairs.data_ptr(), self.codes.data_ptr())
        self.m, self.k = weight_shape(values)  # K as held: padded to 64 in the device layout; x's K is a call's
        self.cols = epilogue_columns(self.m, activation)  # of y: M, or M / 2 under a gated epilogue
        self.dtype = dtype_info(values.dtype).name
        self.device = values.get_device()
        self.activation = activation
        self.kernel = kernel
        self._calls: dict = {}  # per-call key -> (FunctionLaunch, grid, x readable in place, y writable in place)
        self._direct: dict = {}  # (x shape, no bias) -> (BoundLaunch, y shape): contiguous, aligned x
        _LIVE.add(self)

    def __call__(self, x, bias, y) -> None:
        device = self.device
        if current_device() != device:
            with on_device(device):
                self(x, bias, y)
            return
        sx, sy = x.stride(), y.stride()
        key = (x.shape[0], sx, sy, x.data_ptr() & 15, bias is None)
        hit = self._calls.get(key)
        if hit is None:
            hit = self._prepare(key)
        launch, grid, x_in_place, y_in_place = hit
        if not x_in_place:
            x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
        out = y if y_in_place else torch.empty(y.shape, dtype=y.dtype, device=y.device)
        pairs, codes = self.weight
        launch(grid, (x.data_ptr(), pairs, codes, bias.data_ptr() if bias is not None else 0, out.data_ptr(),
                      key[0], self.m, x.shape[1], x.stride(0), out.stride(0)), raw_stream(device))
        if out is not y:
            y.copy_(out)

    def bound(self, x, bias, y):
        """``self(x, bias, y)`` as a closure of one launch; None where the call would copy x or y."""
        key = (x.shape[0], x.stride(), y.stride(), x.data_ptr() & 15, bias is None)
        launch, grid, x_in_place, y_in_place = self._calls.get(key) or self._prepare(key)
        if not (x_in_place and y_in_place):
            return None
        pairs, codes = self.weight
        args = (x.data_ptr(), pairs, codes, bias.data_ptr() if bias is not None else 0, y.data_ptr(), key[0], self.m,
                x.shape[1], x.stride(0), y.stride(0))
        device = self.device
        return lambda: launch(grid, args, raw_stream(device))

    def linear(self, slow: MmaLinear, x, values, metadata, bias) -> torch.Tensor:
        """``y = act(x @ W^T + bias)`` for this weight: ``MmaLinear.held``'s call (held as it is read, or derived and
        checked current by the caller)."""
        # Entries are made for contiguous x with 16-byte aligned rows only (_first_linear): the shape keys them,
        # and the layout is checked, cheaper than x.stride() in the key.
        hit = self._direct.get((x.shape, bias is None))
        x_ptr = x.data_ptr()
        pairs, codes = self.weight
        if hit is None or x_ptr & 15 or not x.is_contiguous() or \
                self.held and (values.data_ptr() != pairs or metadata.data_ptr() != codes) or \
                current_device() != self.device:
            return self._first_linear(slow, x, values, metadata, bias)
        bound, y_shape = hit
        y = x.new_empty(*y_shape)  # ints: output_rows says why
        bound(x_ptr, 0 if bias is None else bias.data_ptr(), y.data_ptr(), raw_stream(self.device))
        return y

    def _first_linear(self, slow: MmaLinear, x, values, metadata, bias) -> torch.Tensor:
        """The call through every layer; where x's rows can be read in place in one launch, its direct entry."""
        if self.held and (values.data_ptr(), metadata.data_ptr()) != self.weight:
            return slow(x, values, metadata, bias)  # the weight's storage moved: its layout is looked up again
        y, x2, y2 = output_rows(x, self.cols)
        if x2.shape[0] and self.m and self.k:
            slow.launch_on(self, x2, bias, y2)
        k = x.shape[-1]  # the weight's K, or less where the layout holds it padded (sparse24/layout.py)
        n = x.numel() // k if k else 0
        if 0 < n <= self.kernel.max_n and x.is_contiguous() and x.data_ptr() % 16 == 0:
            launch, grid = self.kernel.launch_for(n, self.m, self.k, self.dtype, bias is not None, self.activation,
                                                  self.device)
            pairs, codes = self.weight
            with on_device(self.device):  # the weight's tensor maps are encoded here, as a launch on it would
                bound = launch.bind(grid, (x.data_ptr(), pairs, codes, 0 if bias is None else bias.data_ptr(),
                                           y.data_ptr(), n, self.m, k, k, self.cols))
            if bound is not None:  # None: a launch that does more than pack and launch, called as above
                if len(self._direct) >= self._MAX_KEYS:
                    self._direct.clear()
                self._direct[(x.shape, bias is None)] = (bound, tuple(y.shape))
        return y

    def _prepare(self, key):
        n, sx, sy, x_align, no_bias = key
        if len(self._calls) >= self._MAX_KEYS:
            self._calls.clear()
        launch, grid = self.kernel.launch_for(n, self.m, self.k, self.dtype, not no_bias, self.activation,
                                              self.device)
        # Rows of x read as 16-byte vectors: unit stride along K, rows and base 16-byte aligned.
        x_in_place = sx[1] == 1 and sx[0] % 8 == 0 and x_align == 0
        hit = self._calls[key] = (launch, grid, x_in_place, sy[1] == 1)
        return hit
