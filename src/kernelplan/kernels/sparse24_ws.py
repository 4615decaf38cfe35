"""2:4 linear on ``wgmma.mma_async.sp`` (sm_90a), warp-specialized: the kernel is ``cuda/sparse24_ws.cu``.

A producer warp feeds a ring of shared-memory stages through the copy engine
(a tensor map for x, bulk copies for the weight's tiles), consumer warpgroups
run the sparse MMAs, and mbarriers order the two; K may be split across a
cluster of CTAs.  It reads the weight in the one device layout
(``sparse24/layout.py``), as ``cuda_sp`` and ``cuda_wg`` do.

Every operand is read through a tensor map, which encodes its address and
shape (``TensorMaps``, kept per address).

The tile each call runs is ``sparse24_ws_rule.ws_config``'s: a pure function of (N, M, K, SMs, the GPU's facts).
"""

from __future__ import annotations

import ctypes
import functools

from ..activations import GATED_EPILOGUES
from ..errors import KernelPlanError
from .nvrtc import cuda_source
from .sparse24_mma import COMMON_SOURCE, defines
from .gpu_facts import device_facts
from .sparse24 import sm_count
from .direct import FunctionLaunch, XParams, _stream
from .sparse24_wg import WgKernel
from .sparse24_ws_rule import CONSUMER_REGS, WsConfig, sk_plan

def source(cfg: WsConfig, dtype: str, has_bias: bool, activation: str | None, grouped: bool = False,
           scatter: bool = False) -> str:
    """The CUDA C++ of one kernel variant (``kp_sparse24_ws``; ``kp_sparse24_sk`` where ``cfg.sk``,
    ``kp_sparse24_pp`` where ``cfg.pp``; the ``grouped`` form of those two: a MoE layer's experts, ``grouped_linear``,
    whose ``scatter`` form stores each row weighted where its token's pair goes), compiled by NVRTC for sm_90a."""
    kind = {} if cfg.sk or cfg.pp else {"CM": cfg.cm, "KC": cfg.kc, "RECV_BYTES": cfg.recv_bytes}
    if grouped:
        kind |= {"GROUPED": 1, "SCATTER": int(scatter)}
    head = defines(dtype, has_bias, activation, BN=cfg.bn, NI=cfg.ni, WM=cfg.wm, **kind, STAGES=cfg.stages,
                   CONSUMER_REGS=CONSUMER_REGS[2 if cfg.pp else cfg.wm])
    return head + COMMON_SOURCE + cuda_source(_SOURCE[_kind(cfg)])


_SOURCE = {"ws": "sparse24_ws.cu", "sk": "sparse24_sk.cu", "pp": "sparse24_pp.cu"}


def _kind(cfg: WsConfig) -> str:
    return "sk" if cfg.sk else "pp" if cfg.pp else "ws"


_PARAMS = ["tensormap", "tensormap", "tensormap", "*u16", "*u16", "i32", "i32", "i32", "i32"]
_SIZES = [128, 128, 128, 8, 8, 4, 4, 4, 4]
_SK_PARAMS = _PARAMS + ["i32", "i32", "i32", "*u8"]  # tiles along N, whole tiles, parts of the rest, the workspace
_SK_SIZES = _SIZES + [4, 4, 4, 8]
_PP_PARAMS = _PARAMS + ["i32"]  # tiles along N
_PP_SIZES = _SIZES + [4]


def encode_tensor_map(cu, dtype, address: int, dims: list[int], strides: list[int], box: list[int],
                      swizzle: str) -> bytes:
    """The 128 bytes of a tiled tensor map (``cuTensorMapEncodeTiled``): ``dims`` and ``box`` innermost first,
    ``strides`` in bytes for the dimensions past the first; boxes past the end read as zeros."""
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    err, tmap = cu.cuTensorMapEncodeTiled(
        dtype, len(dims), address, [u64(d) for d in dims], [u64(s) for s in strides], [u32(b) for b in box],
        [u32(1)] * len(dims), cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}"),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err:
        raise KernelPlanError(f"a tensor map over {address:#x} (dims {dims}, byte strides {strides}, box {box}) "
                              f"cannot be encoded: {err.name}")
    return ctypes.string_at(tmap.getPtr(), 128)


class TensorMaps:
    """The tensor maps of one kernel variant's operands, by their address and shape: the most recent ones.

    * x [N, K] (2-byte elements): boxes of ``rows`` x 64 columns, 128-byte swizzle (wgmma's B layout);
    * the layout's values [tiles, K/64, 256] and metadata [tiles, K/64, 32] (4-byte words): boxes of one
      64-column step of ``tiles`` 16-row tiles; the values' box reorders each step's core matrices so that
      wgmma reads the CTA's rows as one operand (5 dimensions, the tile's stride not the outermost).  With
      ``gated``, the same boxes take ``tiles / 2`` tiles from each half of W's rows (a gated epilogue's pairs).

    Encoding is a host call; a call whose x sits where an earlier one did (a
    CUDA graph, a decode loop's reused buffers) packs bytes it already has.
    """

    MAX_X = 64  # x moves between calls
    MAX_W = 4096  # weights stay: a model's layers of one variant (256 bytes each)
    MAX_X_PARAMS = 256  # x's maps by address, one table per shape of x: what every bound launch of it reads

    def __init__(self, rows: int, tiles: int, dtype: str, gated: bool = False):
        from cuda.bindings import driver as cu

        self.rows, self.tiles, self.gated, self._cu = rows, tiles, gated, cu
        kinds = cu.CUtensorMapDataType
        self._x_dtype = {"bf16": kinds.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, "f16": kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}[dtype]
        self._word = kinds.CU_TENSOR_MAP_DATA_TYPE_UINT32
        self._x: dict = {}
        self._w: dict = {}
        self._x_params: dict = {}

    def x(self, x: int, n: int, k: int, stride: int) -> bytes:
        key = (x, n, k, stride)
        hit = self._x.get(key)
        if hit is None:
            if stride % 8 or x % 16:
                raise KernelPlanError(f"x at {x:#x} with row stride {stride} elements cannot be read through a "
                                      f"tensor map: rows must be 16-byte aligned (x.contiguous() is)")
            hit = self._keep(self._x, self.MAX_X, key, encode_tensor_map(self._cu, self._x_dtype, x, [k, n], [stride * 2],
                                                             [64, self.rows], "128B"))
        return hit

    def x_params(self, n: int, k: int, stride: int) -> XParams:
        """x's maps of this shape by x's address, for bound launches (``BoundLaunch``): one table for all of them,
        so that a loop over a model's layers finds x's map where the layer before put it."""
        key = (n, k, stride)
        table = self._x_params.get(key)
        if table is None:
            table = self._keep(self._x_params, self.MAX_X, key,
                               XParams(lambda x: self.x(x, n, k, stride), self.MAX_X_PARAMS))
        return table

    def w(self, values: int, codes: int, m: int, k: int, groups: int = 1) -> tuple[bytes, bytes]:
        """The maps of W's ``m`` rows; gated, those are ``groups`` weights end to end (a grouped launch's experts),
        each two halves."""
        key = (values, codes, m, k, groups)
        hit = self._w.get(key)
        if hit is None and self.gated:
            # A dimension for the half of W's rows (sparse24_ring.cuh, load_w): one box of `tiles` tiles a half, the
            # first half's then the second's, in the order of the plain box; each half's tiles past it read as zeros.
            # A step's k32 u and matrix j (256 bytes apart, 512 along u) are one dimension of 4.  The halves of
            # consecutive weights are consecutive, so one dimension of 2 x groups holds them all.
            halves, steps = 2 * groups, -(-k // 64)  # K padded to 64 (sparse24/layout.py, padded_k)
            half = m // (16 * halves)
            hit = self._keep(self._w, self.MAX_W, key, (
                encode_tensor_map(self._cu, self._word, values, [64, half, halves, 4, steps],
                                  [steps * 1024, half * steps * 1024, 256, 1024], [64, self.tiles // 2, 2, 4, 1], "NONE"),
                encode_tensor_map(self._cu, self._word, codes, [32, steps, half, halves],
                                  [128, steps * 128, half * steps * 128], [32, 1, self.tiles // 2, 2], "NONE")))
        elif hit is None:
            tiles, steps = -(-m // 16), -(-k // 64)
            hit = self._keep(self._w, self.MAX_W, key, (
                # (h, g, t pairs of one k32's matrix j, tile, j, u, step): the box writes [u][j][tile] (sparse24_ring.cuh)
                encode_tensor_map(self._cu, self._word, values, [64, tiles, 2, 2, steps], [steps * 1024, 256, 512, 1024],
                                  [64, self.tiles, 2, 2, 1], "NONE"),
                encode_tensor_map(self._cu, self._word, codes, [32, steps, tiles], [128, steps * 128],
                                  [32, 1, self.tiles], "NONE")))
        return hit

    @staticmethod
    def _keep(table: dict, most: int, key, value):
        if len(table) >= most:
            table.clear()
        table[key] = value
        return value


@functools.lru_cache(maxsize=256)
def _launcher(cfg: WsConfig, dtype: str, has_bias: bool, activation: str | None, device_index: int):
    from cuda.bindings import driver as cu

    from . import nvrtc
    from .direct import _param_sizes

    name = f"kp_sparse24_{_kind(cfg)}"
    fn = nvrtc.function(source(cfg, dtype, has_bias, activation), name, device_index, WsKernel.architecture)
    err, = cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 cfg.shared)
    if err:
        raise KernelPlanError(f"{name} ({cfg}) cannot have {cfg.shared} bytes of shared memory on "
                              f"cuda:{device_index}: {err.name}")
    want = {"ws": _SIZES, "sk": _SK_SIZES, "pp": _PP_SIZES}[_kind(cfg)]
    sizes = _param_sizes(cu, fn)
    if sizes != want:
        raise KernelPlanError(f"{name}: compiled parameter sizes {sizes} are not the launcher's {want}")
    maps = TensorMaps(cfg.bn // cfg.cm, 4 * cfg.wm, dtype, gated=activation in GATED_EPILOGUES)
    kind = {"ws": MapLaunch, "sk": StreamKLaunch, "pp": PingPongLaunch}[_kind(cfg)]
    return kind(fn, f"{name} {cfg} {dtype}", cfg, maps, device_index)


class MapLaunch(FunctionLaunch):
    """A launch of ``sparse24_ws.cu``: the 2:4 kernels' arguments (x, values, codes, bias, y, N, M, K, x row stride,
    y row stride) with the operands passed as their tensor maps."""

    __slots__ = ("cfg", "maps")
    _TYPES = _PARAMS

    def __init__(self, fn, name: str, cfg: WsConfig, maps: TensorMaps, device_index: int):
        super().__init__(fn, name, self._TYPES, cfg.threads, cfg.shared, pick=self._mapped)
        self.cfg, self.maps = cfg, maps

    def _mapped(self, a: tuple) -> tuple:
        maps = self.maps
        return (maps.x(a[0], a[5], a[7], a[8]), *maps.w(a[1], a[2], a[6], a[7]), a[3], a[4], a[5], a[6], a[7], a[9])

    def _grid_params(self, grid: tuple, args: tuple) -> tuple[tuple, tuple]:
        """The launch's grid and parameters."""
        return grid, self._mapped(args)

    def launch_params(self, grid: tuple, args: tuple):
        return *self._grid_params(grid, args), self.maps.x_params(args[5], args[7], args[8])


class StreamKLaunch(MapLaunch):
    """A persistent variant's launch: its grid and split from ``sk_plan``, and, where a tile is split, a workspace
    from torch's allocator on the launch's stream (so graphs and other streams each get their own) whose flags
    are zeroed by ``cuMemsetD32Async`` before the kernel: the parts a CTA hands over and the flags that order them.
    """

    __slots__ = ("device", "sms", "_plans")
    _TYPES = _SK_PARAMS

    def __init__(self, fn, name: str, cfg: WsConfig, maps: TensorMaps, device_index: int):
        super().__init__(fn, name, cfg, maps, device_index)
        self.device, self.sms = device_index, sm_count(device_index)
        self._plans: dict = {}  # (N, M, K) -> SkPlan: a dictionary hit costs less host time than sk_plan's cache

    def launch_params(self, grid: tuple, args: tuple):
        return None  # a split tail takes a workspace each call

    def __call__(self, grid: tuple, args: tuple, stream: int) -> None:
        import torch

        n, m, k = args[5], args[6], args[7]
        plan = self._plans.get((n, m, k))
        if plan is None:
            if len(self._plans) >= 256:
                self._plans.clear()
            plan = self._plans[n, m, k] = sk_plan(self.cfg, n, m, k, self.sms)
        work, address = None, 0
        if plan.slots:
            work = torch.empty(plan.workspace_bytes // 4, dtype=torch.int32, device=self.device)
            address = work.data_ptr()
            err, = self._cu.cuMemsetD32Async(address, 0, plan.slots, _stream(self._cu, stream))
            if err:
                raise KernelPlanError(f"{self.name}: zeroing its {plan.slots} flags failed: {err.name}")
        params = self._mapped(args) + (plan.tiles_n, plan.dp_tiles, plan.splits, address)
        FunctionLaunch.__call__(self, (plan.grid, 1, 1), params, stream, packed=True)


class PingPongLaunch(MapLaunch):
    """A ping-pong launch: one CTA per SM, or one per tile where there are fewer tiles."""

    __slots__ = ("sms",)
    _TYPES = _PP_PARAMS

    def __init__(self, fn, name: str, cfg: WsConfig, maps: TensorMaps, device_index: int):
        super().__init__(fn, name, cfg, maps, device_index)
        self.sms = sm_count(device_index)

    def problem_grid(self, n: int, m: int) -> tuple[int, int, int]:
        """The grid this launch takes for ``n`` rows of x and ``m`` rows of W."""
        return min(self.sms, -(-n // self.cfg.bn) * -(-m // self.cfg.rows)), 1, 1

    def _grid_params(self, grid: tuple, args: tuple) -> tuple[tuple, tuple]:
        n, m = args[5], args[6]
        return self.problem_grid(n, m), self._mapped(args) + (-(-n // self.cfg.bn),)

    def __call__(self, grid: tuple, args: tuple, stream: int) -> None:
        FunctionLaunch.__call__(self, *self._grid_params(grid, args), stream, packed=True)


class WsKernel(WgKernel):
    """``cuda_wg``'s layout, sizes and architecture (sm_90a: wgmma, setmaxnreg); its own tiles and launch."""

    name = "cuda_ws"
    source = staticmethod(source)

    def config(self, n, m, k, device, activation=None):
        """The tile this process tuned for the problem (``sparse24/tiles.py``, opt-in), else the rule's, with the
        device's own facts (its cluster slots and DRAM bandwidth)."""
        from ..sparse24.dispatch import config_for
        from ..sparse24.tiles import tuned_tile

        gated = activation in GATED_EPILOGUES
        return (tuned_tile(device, n, m, k, gated, self.name)
                or config_for(self.name, n, m, k, sm_count(device), gated, device_facts(device)))

    def launch_config(self, cfg: WsConfig, n, m, dtype, has_bias, activation, device):
        if cfg.sk or cfg.pp:  # the launch takes its grid from the problem (sk_plan; one CTA an SM)
            return _launcher(cfg, dtype, has_bias, activation, device), (0, 0, 0)
        return _launcher(cfg, dtype, has_bias, activation, device), cfg.grid(n, m)
