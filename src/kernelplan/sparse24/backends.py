"""GPU backends of the 2:4 linear, registered with ``plan.GemmSparse24Plan``.

* ``triton``, ``triton_bfe``, ``triton_m128``: ``kernels/sparse24.py``, the
  compressed tile expanded in registers (two expansion cuts, two tile shapes);
* ``cuda_mma``: CUDA C++ for n <= 16 (``kernels/sparse24_mma.py``), dense MMAs on
  a tiled copy of the weight;
* ``cuda_sp``: CUDA C++ for n <= 64 on the sparse tensor cores (``mma.sp``,
  ``kernels/sparse24_sp.py``), reading the one device layout;
* ``cuda_wg``: Hopper ``wgmma.sp`` (``kernels/sparse24_wg.py``) on the same layout;
* ``cuda_ws``: the same instruction, warp-specialized with TMA copies (``kernels/sparse24_ws.py``);
* ``cusparselt``: cuSPARSELt through nvmath-python (``cusparselt.py``), for large N;
* ``dense``: the weight decompressed once (cached with it) and a cuBLAS GEMM:
  the floor that keeps dispatch from ever losing to dense, at the price of
  a dense copy of each weight it is chosen for.

What each measured is in ``bench/results/sparse24-*.json`` (the README's table) and the
decision records ``docs/design/0001``, ``0002``.

By default (memory="compact") the rule of ``dispatch.py`` picks among the
kernels of the one layout and nothing is timed.  Under memory="fast", ``tuning.tune``
times every candidate on the caller's tensors and stores the fastest per
(device, M, K, N bucket, dtype, epilogue) in the plan cache; the functional path
calls it once per bucket, on CUDA, outside graph capture.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..activations import ACTIVATIONS
from ..dtypes import dtype_info
from ..kernels import triton_reason
from ..plan import Backend, PrecisionGuarantee
from .cusparselt import CusparseLtSparse24Backend
from .dispatch import runs_mma_sp, runs_sm90a
from .format import derived_from
from .layout import PUBLIC, SP_LAYOUT
from .plan import GemmSparse24Args, GemmSparse24Plan, ungated

GPU_DTYPES = ("f32", "f16", "bf16")


def _sm_count(device: str) -> int:
    from ..kernels.sparse24 import sm_count

    dev = torch.device(device)
    return sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 4


@functools.lru_cache(maxsize=4096)
def _triton_config(desc, bfe: bool, wide: bool = False):  # per call, so memoised: the device lookup is microseconds
    from ..kernels.sparse24 import config_for

    return config_for(desc.n, desc.m, desc.k, _sm_count(desc.device), dtype_info(desc.dtype).itemsize, bfe=bfe,
                      wide=wide)


class TritonSparse24Backend(Backend):
    name = "triton"
    # Timed by tuning on CUDA, below the dense floor when nothing is measured: its lead over
    # dense depends on the shape (1.05x at 4096x4096, up to 1.2x at 28672x8192 on an H200).
    # On CPU it is the interpreter, a test tool: by name only.
    priority = 1
    bfe = False  # how the expansion cuts each group's code out (kernels/sparse24.py, _EXPAND_BFE)
    wide = False  # 128-row tiles at N tiles of 32 and 64 (kernels/sparse24.py, _wide_config)

    def priority_for(self, desc) -> int:
        return self.priority if desc.device.startswith("cuda") else -1

    def supports(self, desc) -> str | None:
        if desc.dtype not in GPU_DTYPES:
            return f"dtype {desc.dtype} is not one of {GPU_DTYPES}"
        if desc.k % 64:
            return f"K = {desc.k} is not a multiple of 64, the kernel's smallest K tile"
        if (why := ungated(desc, self.name)) is not None:
            return why
        if desc.dtype == "bf16" and not desc.device.startswith("cuda"):
            # Measured: results off by ~1e9 through the interpreter, whose bf16 arithmetic is wrong.
            return "dtype bf16 on CPU: the Triton interpreter computes bf16 arithmetic wrongly; use f32 or f16 there"
        return triton_reason(desc.device)

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            "f32" if desc.dtype == "f32" else desc.dtype, "f32", deterministic=True, bit_stable=False,
            note="fp32 accumulation; K is split by shape (a fixed order per shape), so bits can change with N",
        )

    def _config(self, desc):
        return _triton_config(desc, self.bfe, self.wide)

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        from ..kernels.sparse24 import launch

        # No plan workspace: a K split keeps its partials in a per-stream scratch (split_scratch).
        launch(args.x, args.values, args.metadata, args.bias, args.y, desc.activation, self._config(desc))

    def bind(self, desc):
        from ..kernels.sparse24 import BoundLinear

        return BoundLinear(self._config(desc), desc.activation, desc.graph)


class TritonBfeSparse24Backend(TritonSparse24Backend):
    """The same kernel, each group's code cut out by ``bfe``: a tuning candidate beside ``triton``.

    Neither cut has won everywhere (``kernels/sparse24.py``, ``_EXPAND_BFE``).
    With the previous group codes, on an H100 bfe ran 8192x28672 at n <= 16 at
    1.50x of dense against 1.24x, on an H200 it ran 28672x8192 at 1.13x against
    1.34x; with the present ones the two are within a few percent on an H200.
    """

    name = "triton_bfe"
    bfe = True

    def supports(self, desc) -> str | None:
        if desc.dtype == "f32":
            return "dtype f32: 32-bit weights are expanded by selects, not PRMT; the kernel is triton's"
        return super().supports(desc)


class TritonWideSparse24Backend(TritonSparse24Backend):
    """The same kernel on 128-row tiles with more K splits, for n > 16: a tuning candidate.

    On an H200 it ran the Llama-70B shapes at n = 32 and 64 at 1.12-1.33x of
    dense where ``triton``'s 64-row tiles gave 0.90-1.19x; on an H100 the 64-row
    tiles were the sweep's best (``kernels/sparse24.py``, ``_wide_config``).
    """

    name = "triton_m128"
    wide = True

    def supports(self, desc) -> str | None:
        if (why := ungated(desc, self.name)) is not None:
            return why
        if desc.n <= 16:
            return f"n = {desc.n} runs 16-wide N tiles; 128-row tiles are a candidate for n > 16"
        if desc.k % 128:
            return f"K = {desc.k} is not a multiple of 128, the K tile of 128-row tiles"
        if desc.dtype == "f32":
            return "dtype f32: 128-row tiles of 32-bit weights overflow shared memory; the kernel is triton's"
        return super().supports(desc)


class CudaMmaSparse24Backend(Backend):
    """CUDA C++ for N <= 16 (``kernels/sparse24_mma.py``): operands straight into MMA registers, weight tiled.

    On an H200 (bf16, the Llama 8B and 70B shapes and the 128256x4096 LM
    head) it ran n = 1 at 1.59-1.79x of dense and n = 16 at 1.52-1.69x, where
    the Triton kernel gave 1.31-1.43x.  Its price: a tiled copy of the values
    and codes kept with each weight it runs.  A tuning candidate on CUDA.
    """

    name = "cuda_mma"
    priority = 1
    what = "two 8-wide MMA tiles"
    max_n = 16  # kernels/sparse24_mma.py MAX_N; here so that supports() imports no kernel module
    chunks = False  # more rows of x than max_n run in chunks (kernels/sparse24_mma.py, MmaLinear.launch)
    gated = False  # has the gated epilogue (activations.GATED_EPILOGUES)
    pads_k = False  # reads the device layout's K padded to 64, x's columns past K as zeros (layout.padded_k)

    def kernel(self):
        from ..kernels.sparse24_mma import TiledKernel

        return TiledKernel()

    def supports(self, desc) -> str | None:
        from ..kernels.nvrtc import nvrtc_reason

        if not self.gated and (why := ungated(desc, self.name)) is not None:
            return why
        if desc.dtype not in ("f16", "bf16"):
            return f"dtype {desc.dtype}: the kernel multiplies f16 and bf16 on the tensor cores"
        if desc.n > self.max_n and not self.chunks:
            return f"n = {desc.n}: the kernel takes at most {self.max_n} rows of x ({self.what})"
        if desc.k % 64 and not self.pads_k:
            return f"K = {desc.k} is not a multiple of 64, the kernel's K step (cuda_sp and cuda_ws take it padded)"
        why = nvrtc_reason(desc.device)
        if why is None and not runs_mma_sp(torch.cuda.get_device_capability(torch.device(desc.device))):
            return f"device {desc.device}: bf16 MMA (mma.sync, mma.sp) needs compute capability 8.0 or newer"
        return why

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(desc.dtype, "f32", deterministic=True, bit_stable=False,
                                  note="fp32 accumulation; K slices per CTA chosen by shape, summed in a fixed order")

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        self.bind(desc).launch(args.x, args.values, args.metadata, args.bias, args.y)

    def bound(self, desc, args: GemmSparse24Args):
        """``run(desc, args, None)`` resolved once, or None (``MmaLinear.bound``)."""
        return self.bind(desc).bound(args.x, args.values, args.metadata, args.bias, args.y)

    def bind(self, desc):
        from ..kernels.sparse24_mma import MmaLinear

        return MmaLinear(desc.activation, self.kernel())


class CudaSpSparse24Backend(CudaMmaSparse24Backend):
    """CUDA C++ for N <= 64 on the sparse tensor cores (``kernels/sparse24_sp.py``): ``mma.sp``, x staged per CTA.

    The values and positions go to the tensor cores as stored, in the one
    device layout (``sparse24/layout.py``): read as held where the weight is
    held in it (``Sparse24Linear``), else derived once beside the public
    format.  Both operands are staged in shared memory by cp.async.  The
    rule's kernel at n <= 8 on Hopper's tall weights and wide weights of few
    rows, and at every n on Ampere and Ada (``dispatch.py``); what it measured
    is in ``bench/results/sparse24-sweep-*.json`` and ``sparse24-small-n-*.json``.
    """

    name = "cuda_sp"
    layouts = (PUBLIC, SP_LAYOUT)  # reads a weight held in the device layout as it is, or derives it
    what = "eight 8-wide sparse MMA tiles"
    max_n = 64  # kernels/sparse24_sp.py MAX_N
    chunks = True
    gated = True
    pads_k = True

    def priority_for(self, desc) -> int:
        # A tuning candidate (memory="fast") up to its widest tile; past it, chunks of x re-read W: by rule only.
        return self.priority if desc.n <= self.max_n else -1

    def kernel(self):
        from ..kernels.sparse24_sp import SpKernel

        return SpKernel()


class CudaWgSparse24Backend(CudaMmaSparse24Backend):
    """CUDA C++ on Hopper's sparse warpgroup MMA (``wgmma.mma_async.sp``, ``kernels/sparse24_wg.py``), any N.

    Reads the layout of ``cuda_sp`` (one copy shared by both, 0.5625x of the
    dense bytes); x staged in wgmma's swizzled layout by cp.async.  sm_90a only.
    Superseded in the rule by ``cuda_ws`` (docs/design/0005); available by name
    and a tuning candidate under memory="fast".
    """

    name = "cuda_wg"
    layouts = (PUBLIC, SP_LAYOUT)
    what = "wgmma.sp N tiles"
    max_n = 1 << 31
    gated = False

    def kernel(self):
        from ..kernels.sparse24_wg import WgKernel

        return WgKernel()

    def supports(self, desc) -> str | None:
        why = super().supports(desc)
        if why is None and not runs_sm90a(torch.cuda.get_device_capability(torch.device(desc.device))):
            return f"device {desc.device}: wgmma.mma_async.sp is an sm_90a (Hopper) instruction"
        return why


class CudaWsSparse24Backend(CudaWgSparse24Backend):
    """``wgmma.mma_async.sp`` warp-specialized (``kernels/sparse24_ws.py``): a producer warp copies through the
    copy engine (TMA), consumer warpgroups multiply, mbarriers between; K split across a CTA cluster.

    Reads the one layout, as ``cuda_wg`` does.  sm_90a only.  The rule's kernel past
    n = 16 on Hopper (``dispatch.py``).
    """

    name = "cuda_ws"
    what = "warp-specialized wgmma.sp tiles"
    gated = True
    pads_k = True  # x's columns past K read as zeros by its tensor map

    def kernel(self):
        from ..kernels.sparse24_ws import WsKernel

        return WsKernel()


def _dense_weight(values: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    from .format import Sparse24Weight

    return Sparse24Weight(values.detach(), metadata, _validate=False).decompress()


class DenseSparse24Backend(Backend):
    name = "dense"
    priority = 5

    def supports(self, desc) -> str | None:
        if desc.dtype not in GPU_DTYPES:
            return f"dtype {desc.dtype} is not one of {GPU_DTYPES}"
        if (why := ungated(desc, self.name)) is not None:
            return why
        if not desc.device.startswith("cuda"):
            return f"device {desc.device}: the dense floor is for CUDA; the reference is the CPU path"
        return None

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            "tf32" if desc.dtype == "f32" and torch.backends.cuda.matmul.allow_tf32 else desc.dtype,
            "f32", deterministic=True, bit_stable=False,
            note="cuBLAS through F.linear on a cached dense copy of the weight; f16 may reduce in f16 "
            "when torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is set",
        )

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        w = derived_from(args.values, args.metadata, "dense", _dense_weight)
        # Straight into y: F.linear's own output and a copy would cost one more pass over y.
        if args.bias is None:
            torch.mm(args.x, w.t(), out=args.y)
        else:
            torch.addmm(args.bias, args.x, w.t(), out=args.y)
        if desc.activation:
            args.y.copy_(ACTIVATIONS[desc.activation].fn(args.y.float()))

    def bind(self, desc):
        # F.linear, as nn.Linear calls it: on a host-bound call it costs what the dense model's layer costs.
        act = ACTIVATIONS[desc.activation].fn if desc.activation else None

        def call(x, values, metadata, bias):
            y = F.linear(x, derived_from(values, metadata, "dense", _dense_weight), bias)
            return y if act is None else y.copy_(act(y.float()))

        return call


GemmSparse24Plan.registry.register(TritonSparse24Backend())
GemmSparse24Plan.registry.register(TritonBfeSparse24Backend())
GemmSparse24Plan.registry.register(TritonWideSparse24Backend())
GemmSparse24Plan.registry.register(CudaMmaSparse24Backend())
GemmSparse24Plan.registry.register(CudaSpSparse24Backend())
GemmSparse24Plan.registry.register(CudaWgSparse24Backend())
GemmSparse24Plan.registry.register(CudaWsSparse24Backend())
GemmSparse24Plan.registry.register(DenseSparse24Backend())
GemmSparse24Plan.registry.register(CusparseLtSparse24Backend())
