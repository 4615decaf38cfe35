"""A MoE layer's experts in one launch: a ``wgmma.sp`` kernel over all experts' tiles.

``cuda/sparse24_pp.cu`` (persistent, ping-pong) or ``cuda/sparse24_ws.cu`` (a CTA a tile, for experts of many rows)
with ``GROUPED`` (``cuda/sparse24_grouped.cuh``): W is the experts' weights end to end (E x M rows in the one device
layout, which is the layout of one tall weight), x's rows are sorted by expert, and ``offsets`` (on the device) says
where each expert's rows start, so the launch needs no host sync and a CUDA graph can hold it.  Each CTA scans the
experts' tile counts, then walks the tiles (ping-pong) or takes its own (one a tile).  ``nn/experts.py`` calls it.

The epilogue is the plain kernel's: an activation, or a gated one (each expert's rows its gate and up halves, y's
columns act(gate) * up), which takes the gating's pass over the ``[S, 2I]`` output and its torch kernels out of a
MoE layer's forward.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

import torch

from ..activations import GATED_EPILOGUES
from ..dtypes import dtype_info
from ..errors import KernelPlanError
from ..sparse24.dispatch import runs_sm90a
from . import have_triton, on_device, raw_stream
from .direct import BoundLaunch, FunctionLaunch, _param_sizes
from .sparse24_sp import SM_SHARED
from .sparse24_ws import _PARAMS, _PP_PARAMS, _PP_SIZES, _SIZES, TensorMaps, source
from .sparse24_ws_rule import WsConfig, _deepest

MAX_EXPERTS = 1024  # sparse24_grouped.cuh's kMaxExperts: the scan of tile counts is in shared memory
_SCAN_BYTES = 4 * (MAX_EXPERTS + 1)
_GROUP_PARAMS = ["*i32", "i32"]  # the offsets, the experts
_SCATTER_PARAMS = ["*i64", "*fp32"]  # each row's (token, k) pair, the pairs' routing weights


def grouped_config(m: int, s: int, experts: int, gated: bool = False) -> WsConfig:
    """The tile for ``s`` rows of x over ``experts`` experts of M = ``m`` rows, from the rows an expert hit gets if
    they spread evenly: as many (16 to 128, in powers of two: a row or two an expert is a decode's), or 256 where
    that is more than 256; and 128 rows of W where M allows (a tile never spans two experts), else 64.  Gated, 128:
    64 of each half, whose map reads rows past a half as zeros.

    Tiles of 256 rows of x are one a CTA (``sparse24_ws.cu``: a ping-pong warpgroup cannot hold their accumulators),
    and each wgmma reads W's fragment for twice the rows (docs/design/0012).  Against 128-row tiles at 2048 tokens
    (H100, ``sparse24-experts-rows-h100.json``): 1.06-1.09x at 512 rows an expert, 1.04-1.09x at 137-192, but
    0.87-0.95x at 256, where about half the experts get a second, nearly empty 256-row tile (docs/design/0033)."""
    rows = -(-s // max(1, min(experts, s)))
    wide = GROUPED_ROWS[-1]
    if rows > 256 and wide >= 256:
        return _tile(256, m, gated)
    return _tile(min(128, wide, max(GROUPED_ROWS[0], 1 << (rows - 1).bit_length())), m, gated)


GROUPED_ROWS = (16, 32, 64, 128, 256)  # the rows of x a tile of grouped_config, whatever the tokens


@functools.lru_cache(maxsize=256)  # once per shape, not per call: grouped_linear asks on every call
def _tile(bn: int, m: int, gated: bool) -> WsConfig:
    cfg = _deepest(bn, 2 if m % 128 == 0 or gated else 1, 1, 1, pp=bn < 256)
    while cfg.shared + _SCAN_BYTES > SM_SHARED:  # the scan's static array beside the ring (256 x 64: one stage)
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def grouped_variants(m: int, dtype: torch.dtype, has_bias: bool, epilogue: str | None,
                     scatter: bool = False) -> list[tuple]:
    """``(config, compile)`` of each tile ``grouped_linear`` can pick for experts of M = ``m`` rows, one for each
    width of x's tile: ``compile()`` gives its cubin, from the disk cache or NVRTC, and touches no device (so it may
    run in threads).  What ``kp.warmup`` builds for a MoE layer's experts."""
    from . import nvrtc
    from .sparse24_wg import WgKernel

    gated = epilogue in GATED_EPILOGUES
    name = dtype_info(dtype).name
    return [(cfg, functools.partial(nvrtc.cubin, source(cfg, name, has_bias, epilogue, True, scatter),
                                    WgKernel.architecture)) for cfg in (_tile(bn, m, gated) for bn in GROUPED_ROWS)]


def grouped_load(cfg: WsConfig, dtype: torch.dtype, has_bias: bool, epilogue: str | None, device_index: int,
                 scatter: bool = False) -> None:
    """Load one of ``grouped_variants`` on a device, as ``grouped_linear``'s first call with it would."""
    _launcher(cfg, dtype_info(dtype).name, has_bias, epilogue, scatter, device_index)


def grouped_reason(capability: tuple[int, int] | None, m: int, k: int, experts: int, dtype: torch.dtype) -> str | None:
    """Why ``grouped_linear`` cannot run these experts, or None."""
    if capability is None:
        return "the weights are not on a CUDA GPU"
    if not runs_sm90a(capability):
        return f"compute capability {capability[0]}.{capability[1]}: the grouped kernel is sm_90a code (wgmma.sp)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the kernel takes bf16 and f16"
    if m % 64 or k % 64:
        return f"an expert's weight is [{m}, {k}]: the grouped kernel needs M and K multiples of 64"
    if experts > MAX_EXPERTS:
        return f"{experts} experts: the grouped kernel scans at most {MAX_EXPERTS}"
    if not have_triton():
        return "triton is not installed, and the experts' routing is a Triton kernel: pip install 'kernelplan[gpu]'"
    return None


@functools.lru_cache(maxsize=64)
def _launcher(cfg: WsConfig, dtype: str, has_bias: bool, epilogue: str | None, scatter: bool, device_index: int):
    from cuda.bindings import driver as cu

    from . import nvrtc
    from .sparse24_wg import WgKernel

    name = "kp_sparse24_pp" if cfg.pp else "kp_sparse24_ws"
    fn = nvrtc.function(source(cfg, dtype, has_bias, epilogue, True, scatter), name, device_index,
                        WgKernel.architecture)
    err, = cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 cfg.shared)
    if err:
        raise KernelPlanError(f"the grouped kernel ({cfg}) cannot have {cfg.shared} bytes of shared memory on "
                              f"cuda:{device_index}: {err.name}")
    sizes = _param_sizes(cu, fn)
    params = (_PP_PARAMS if cfg.pp else _PARAMS) + _GROUP_PARAMS + _SCATTER_PARAMS * scatter
    if sizes != (_PP_SIZES if cfg.pp else _SIZES) + [8, 4] + [8, 8] * scatter:
        raise KernelPlanError(f"the grouped kernel: compiled parameter sizes {sizes} are not the launcher's")
    launch = FunctionLaunch(fn, f"{name} grouped {cfg} {dtype} {epilogue}{' scattered' * scatter}", params,
                            cfg.threads, cfg.shared)
    return launch, TensorMaps(cfg.bn, 4 * cfg.wm, dtype, gated=epilogue in GATED_EPILOGUES)


class GroupedBound(BoundLaunch):
    """A grouped launch for one projection and one count of rows, its parameters packed once (the weights' tensor maps,
    the sizes, the grid) but for what each call brings: x (its tensor map, kept by address), y, the offsets, and the
    scattered store's rows and scales.  The grouped launch built its parameters on every call: 21 us of host time on
    the CPU CI machine against 8 us bound (a stubbed driver), a MoE layer taking two (docs/design/0036)."""

    __slots__ = ("_offsets_at", "_scatter_at", "_pack_q", "_pack_qq")

    def __init__(self, launch: FunctionLaunch, grid: tuple, params: tuple, x_map, scatter: bool):
        super().__init__(launch, grid, params, x_map)
        offsets = len(params) - 2 - 2 * scatter  # the offsets, the experts (, the rows, the scales)
        self._offsets_at = self._offsets[offsets]
        self._scatter_at = self._offsets[offsets + 2] if scatter else None
        self._pack_q = struct.Struct("<Q").pack_into
        self._pack_qq = struct.Struct("<QQ").pack_into

    def __call__(self, x: int, y: int, offsets: int, rows: int, scale: int, stream: int) -> None:
        buffers = self._with_x(x)
        storage = buffers[0]
        self._pack_q(storage, self._by_at + 8, y)  # the bias stays as bound
        self._pack_q(storage, self._offsets_at, offsets)
        if self._scatter_at is not None:
            self._pack_qq(storage, self._scatter_at, rows, scale)
        self._launch(buffers, stream)


_BOUND: dict = {}  # grouped_linear's calls, by what fixes their parameters -> GroupedBound
_MAX_BOUND = 256


def _bind(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: torch.Tensor | None, experts: int,
          epilogue: str | None, y: torch.Tensor, scatter: bool) -> GroupedBound:
    from .sparse24 import sm_count

    (s, k), stride = x.shape, x.stride(0)
    m = values.shape[0] * 16 // experts
    gated = epilogue in GATED_EPILOGUES
    cfg = grouped_config(m, s, experts, gated)
    device = x.get_device()  # a CUDA tensor's device always has its index
    launch, maps = _launcher(cfg, dtype_info(x.dtype).name, bias is not None, epilogue, scatter, device)
    tiles = (-(-s // cfg.bn) + experts) * -(-m // cfg.rows)  # tiles at most: each expert's rows round up once
    params = (maps.x(x.data_ptr(), s, k, stride),
              *maps.w(values.data_ptr(), metadata.data_ptr(), experts * m, k, experts if gated else 1),
              0 if bias is None else bias.data_ptr(), y.data_ptr(), s, m, k, y.stride(0)) + (0,) * cfg.pp + \
        (0, experts) + (0, 0) * scatter  # the offsets and the scattered store's operands: each call's
    grid = (min(sm_count(device), tiles) if cfg.pp else tiles, 1, 1)  # persistent, or a CTA a tile (the rest leave)
    return GroupedBound(launch, grid, params, lambda address: maps.x(address, s, k, stride), scatter)


def output_columns(values: torch.Tensor, experts: int, epilogue: str | None) -> int:
    """Columns of ``grouped_linear``'s y: each expert's M (``values`` holds the experts' 16-row tiles end to end), half
    of it under a gated epilogue."""
    m = values.shape[0] * 16 // experts
    return m // 2 if epilogue in GATED_EPILOGUES else m


def grouped_linear(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: torch.Tensor | None,
                   offsets: torch.Tensor, experts: int, epilogue: str | None = None,
                   scatter: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``y[offsets[e]:offsets[e + 1]] = act(x[offsets[e]:offsets[e + 1]] @ W_e^T (+ bias[e]))`` for every expert e, as
    one launch: ``x [S, K]`` (rows sorted by expert, contiguous), ``values`` / ``metadata`` the experts' weights end
    to end in the device layout (E x M rows), ``bias [E, M]`` or None, ``offsets`` int32 ``[E + 1]`` on x's device,
    non-decreasing from 0, ``epilogue`` None, an activation or a gated epilogue (``activations.GATED_EPILOGUES``: y
    is then ``[S, M / 2]``).  Rows of x past ``offsets[E]`` are left unwritten in y.  ``scatter``: ``(y, rows,
    scale)``: row n's result, times ``scale[rows[n]]``, goes to row ``rows[n]`` of that y (``[S, M]``, contiguous;
    ``rows`` int64 ``[S]``, ``scale`` float32): a MoE layer's pairs back in their order and weighted as they are
    stored.  The caller checks ``grouped_reason``; these are internal operands, built by ``Sparse24Experts``."""
    s = x.shape[0]
    y = torch.empty(s, output_columns(values, experts, epilogue), dtype=x.dtype, device=x.device) if scatter is None \
        else scatter[0]
    if s == 0:
        return y
    device = x.get_device()
    # The device too: a bound launch holds a kernel loaded into one device's context, and keyed by addresses alone
    # only the allocator's habits kept another device's weights from finding it.
    key = (device, values.data_ptr(), metadata.data_ptr(), 0 if bias is None else bias.data_ptr(), values.shape[0],
           experts, x.shape, x.stride(0), y.stride(0), x.dtype, epilogue, scatter is None)
    bound = _BOUND.get(key)
    if bound is None:
        if len(_BOUND) >= _MAX_BOUND:
            _BOUND.clear()
        bound = _BOUND[key] = _bind(x, values, metadata, bias, experts, epilogue, y, scatter is not None)
    rows, scale = (0, 0) if scatter is None else (scatter[1].data_ptr(), scatter[2].data_ptr())
    with on_device(device):  # the kernel is loaded into x's device's context, and a launch goes to the current one
        bound(x.data_ptr(), y.data_ptr(), offsets.data_ptr(), rows, scale, raw_stream(device))
    return y
