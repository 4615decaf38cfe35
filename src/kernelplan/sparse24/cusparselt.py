"""The cuSPARSELt backend of the 2:4 linear, through ``nvmath.bindings.cusparseLt``.

cuSPARSELt computes ``D = op(A) op(B)`` with A structured.  We ask it for
``Y^T[M, N] = W[M, K] @ X^T[K, N]``: W is row-major, and X (row-major ``[N, K]``)
read column-major is ``X^T`` with no copy; so is Y written column-major.

* one library handle per device;
* the compressed weight is derived once per weight (``derived_from``), and
  shared by its plans of every N and epilogue;
* N is padded to the library's multiple of 16 (it refuses every other N, and
  N = 1 outright); x and y go through padded buffers then, at the price of
  two small copies;
* plans are cached per (device, M, K, padded N, dtype, activation) in a bounded LRU
  whose evictions free the library objects;
* ``matmul_search`` runs once per key and its result (config id, split-K
  settings) goes to the plan cache, so a new process plans straight from it;
* every call runs on the caller's current torch stream, read at call time,
  so it works under ``torch.cuda.graph`` capture.

Fused here: relu, without a bias (a descriptor attribute).  A bias (whose
pointer a plan would bake in) and the other activations run in one extra
Triton pass over y (``kernels.sparse24.bias_act_``), never a chain of torch
ops.  f32 is refused: cuSPARSELt runs f32 as TF32 with 1:2 sparsity, which is
not our 2:4 format.

The library's opaque structs (handle, descriptors, plan) are allocated here
and filled by the bindings' in-place initialisers (``_dense_descriptor_init``
and friends): nvmath-python 1.0.0's allocating wrappers size them at 512
bytes, while cuSPARSELt 0.8's structs are 1024: the likely cause of a measured
segfault in ``matmul_plan_init`` on the second plan of a process, gone since.  A plan
is initialised once: ``matmul_search`` updates it in place (re-initialising it
after the search crashed cuSPARSELt 0.8 in a measured run).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import triton_reason
from ..plan import Backend, PrecisionGuarantee
from .format import derived_from
from .plan import GemmSparse24Args, ungated

# cudaDataType and cuSPARSE enums the bindings take as plain ints.
_CUDA_DTYPE = {"f16": 2, "bf16": 14}
_STRUCT_BYTES = 4096  # >= every cuSPARSELt opaque struct (1024 in 0.8), with room to grow
_ORDER_COL, _ORDER_ROW = 1, 2
_OP_N = 0
_ALIGN = 16  # bytes
_MAX_PLANS = 256
_N_MULTIPLE = 16  # the library's rule for N of 16-bit 2:4 problems
_SEARCH_OP = "cusparselt_search"


def _lib():
    from nvmath.bindings import cusparseLt

    return cusparseLt


def available() -> str | None:
    """None if nvmath-python's cuSPARSELt bindings load, else why not."""
    try:
        _lib()
    except Exception as e:  # ImportError, or the shared library missing
        return f"nvmath-python's cuSPARSELt bindings do not load ({type(e).__name__}: {e}); pip install nvmath-python"
    return None


def _struct() -> tuple[np.ndarray, int]:
    """Host memory for one opaque library struct, 64-byte aligned; keep the array alive."""
    buf = np.zeros(_STRUCT_BYTES + 64, dtype=np.uint8)
    ptr = buf.ctypes.data
    return buf, ptr + (-ptr % 64)


_handles: dict[int, tuple[np.ndarray, int]] = {}
_lock = threading.Lock()


def _handle(index: int) -> int:
    with _lock:
        if index not in _handles:
            buf, ptr = _struct()
            with torch.cuda.device(index):
                _lib()._init(ptr)
            _handles[index] = (buf, ptr)
        return _handles[index][1]


# What matmul_search decides, as stored in the plan cache: the algorithm attributes by name.
_ALG_ATTRS = ("config_id", "split_k", "split_k_mode", "split_k_buffers")


def _alg_attr(name: str) -> int:
    return getattr(_lib().MatmulAlgAttribute, name.upper())


@dataclass(frozen=True)
class _Key:
    device: int
    m: int
    k: int
    n: int
    dtype: str
    relu: bool


class _Plan:
    """The library objects of one problem; destroyed when evicted."""

    def __init__(self, key: _Key):
        lib = _lib()
        self.key = key
        h = self.handle = _handle(key.device)
        dt = _CUDA_DTYPE[key.dtype]
        self._buffers, (self.mat_a, self.mat_b, self.mat_d, self.matmul, self.alg, self._plan) = zip(
            *(_struct() for _ in range(6)))
        lib._structured_descriptor_init(h, self.mat_a, key.m, key.k, key.k, _ALIGN, dt, _ORDER_ROW,
                                        lib.Sparsity.SPARSITY_50_PERCENT)
        lib._dense_descriptor_init(h, self.mat_b, key.k, key.n, key.k, _ALIGN, dt, _ORDER_COL)
        lib._dense_descriptor_init(h, self.mat_d, key.m, key.n, key.m, _ALIGN, dt, _ORDER_COL)
        lib._matmul_descriptor_init(h, self.matmul, _OP_N, _OP_N, self.mat_a, self.mat_b, self.mat_d, self.mat_d,
                                    lib.ComputeType.COMPUTE_32F)
        if key.relu:
            one = np.array([1], dtype=np.int32)
            lib.matmul_desc_set_attribute(h, self.matmul, lib.MatmulDescAttribute.ACTIVATION_RELU,
                                          one.ctypes.data, one.nbytes)
        lib._matmul_alg_selection_init(h, self.alg, self.matmul, lib.MatmulAlg.DEFAULT)
        self.plan = None
        self.workspace_size = 0
        self.alg_found: dict | None = None  # set_alg's: what weights' own plans are planned with
        self.alive = True

    def set_alg(self, found: dict) -> None:
        self.alg_found = found
        lib = _lib()
        for name in _ALG_ATTRS:
            value = np.array([found[name]], dtype=np.int32)
            lib.matmul_alg_set_attribute(self.handle, self.alg, _alg_attr(name), value.ctypes.data, value.nbytes)

    def get_alg(self) -> dict:
        lib = _lib()
        found = {}
        for name in _ALG_ATTRS:
            value = np.zeros(1, dtype=np.int32)
            lib.matmul_alg_get_attribute(self.handle, self.alg, _alg_attr(name), value.ctypes.data, value.nbytes)
            found[name] = int(value[0])
        return found

    def init_plan(self) -> None:
        lib = _lib()
        lib._matmul_plan_init(self.handle, self._plan, self.matmul, self.alg)
        self.plan = self._plan
        self.workspace_size = lib.matmul_get_workspace(self.handle, self.plan)

    def __del__(self, _exiting=sys.is_finalizing):  # a weight's own plan goes with its cache entry (_weight_plan)
        # At interpreter exit this module's globals may already be gone (a GPU test run printed
        # "'NoneType' object is not callable" from destroy), and the exiting process frees the
        # library's objects anyway.
        if getattr(self, "alive", False) and not _exiting():
            self.destroy()

    def destroy(self) -> None:
        """Release the library objects, once: an evicted plan is destroyed, then collected."""
        if not self.alive:
            return
        self.alive = False
        lib = _lib()
        if self.plan is not None:
            lib._matmul_plan_destroy(self.plan)
        lib._matmul_alg_selection_destroy(self.alg)
        for d in (self.mat_a, self.mat_b, self.mat_d):
            lib._mat_descriptor_destroy(d)


_plans: "OrderedDict[_Key, _Plan]" = OrderedDict()
_ALPHA = np.array([1.0], dtype=np.float32)


def release_plans() -> None:
    """Destroy every cached cuSPARSELt plan of this process; the next call plans again from the plan cache."""
    while _plans:
        _plans.popitem()[1].destroy()
_BETA = np.array([0.0], dtype=np.float32)


def _compress(plan: _Plan, values: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    """W in cuSPARSELt's compressed layout, compressed against ``plan``."""
    from .format import Sparse24Weight

    lib = _lib()
    dense = Sparse24Weight(values.detach(), metadata, _validate=False).decompress().contiguous()
    size, buffer_size = lib.sp_mma_compressed_size(plan.handle, plan.plan)
    out = torch.empty(size, dtype=torch.uint8, device=values.device)
    scratch = torch.empty(max(buffer_size, 1), dtype=torch.uint8, device=values.device)
    stream = torch.cuda.current_stream(values.device).cuda_stream
    lib.sp_mma_compress(plan.handle, plan.plan, dense.data_ptr(), out.data_ptr(), scratch.data_ptr(), stream)
    return out


def _weight_plan(plan: _Plan, values: torch.Tensor, metadata: torch.Tensor) -> tuple[_Plan, torch.Tensor]:
    """This weight's own plan of ``plan``'s algorithm, and W in cuSPARSELt's layout: one copy per weight.

    The compressed bytes depend on the weight alone.  Measured on an H200 with
    cuSPARSELt 0.8 (bf16 8192x8192 and 4096x14336, f16 4096x4096 and
    14336x4096): copies compressed against the plans of n = 16 to 4096, whatever
    config id their search chose, were byte-identical to each other and to the
    descriptor-only ``sp_mma_compress2``, and every one of those plans ran right
    on the copy of any other.  So every N bucket and epilogue of a weight shares
    one copy (9/16 of dense bytes); it used to keep one per N bucket.

    Each plan still compresses the weight once, before it first runs, and the
    result is checked against the shared copy (a copy of its own is kept if the
    bytes ever differ): in a measured f16 run a plan that had never compressed,
    run on another plan's copy, failed (a CUBLAS execution failure after it).
    A copy compressed against a plan that had already run a matmul, or its
    search, gave wrong products (relative error 1.0-1.4, f16), so the first
    compression is the shared one.  Plans are per weight and N bucket (host structs).
    """
    k = plan.key

    def own_plan(v, meta):
        own = _Plan(k)
        own.set_alg(plan.alg_found)
        own.init_plan()
        fresh = _compress(own, v, meta)
        shared = derived_from(v, meta, f"cusparselt:{k.dtype}", lambda *_: fresh)
        return own, shared if shared is fresh or torch.equal(shared, fresh) else fresh

    return derived_from(values, metadata, f"cusparselt-plan:{k.dtype}:n={k.n}:relu={k.relu}", own_plan)


def _workspace(plan: _Plan, device) -> torch.Tensor | None:
    # The size is known only once the searched plan exists, so it comes from torch's caching
    # allocator per call (the plan contract's workspace_size says 0) rather than from the caller.
    return torch.empty(plan.workspace_size, dtype=torch.uint8, device=device) if plan.workspace_size else None


def _run(plan: _Plan, a: torch.Tensor, x: torch.Tensor, y: torch.Tensor, workspace: torch.Tensor | None, search: bool):
    """One matmul (or the search), with the library's status turned into a KernelPlanError."""
    lib = _lib()
    streams = np.array([torch.cuda.current_stream(x.device).cuda_stream], dtype=np.int64)
    ws = workspace.data_ptr() if workspace is not None else 0
    fn = lib.matmul_search if search else lib.matmul
    try:
        fn(plan.handle, plan.plan, _ALPHA.ctypes.data, a.data_ptr(), x.data_ptr(), _BETA.ctypes.data,
           y.data_ptr(), y.data_ptr(), ws, streams.ctypes.data, 1)
    except lib.cuSPARSELtError as e:
        from ..errors import Unsupported

        k = plan.key
        raise Unsupported(
            f"cuSPARSELt failed on n={k.n}, m={k.m}, k={k.k}, {k.dtype} ({'search' if search else 'matmul'}: "
            f"{e}); select another backend with PlanPreference.only('dense') or 'triton'"
        ) from e


def plan_for(key: _Key, args: GemmSparse24Args) -> _Plan:
    """The cached plan of ``key``; a new one is planned from the stored search, or searched on ``args``."""
    plan = _plans.get(key)
    if plan is not None:
        _plans.move_to_end(key)
        return plan
    from ..cache import plan_cache

    plan = _Plan(key)
    problem = {"m": key.m, "k": key.k, "n": key.n, "dtype": key.dtype, "relu": key.relu}
    stored = plan_cache().get(_SEARCH_OP, problem, device=f"cuda:{key.device}")
    if stored is not None:
        plan.set_alg(stored)
        plan.init_plan()
    else:  # search on the caller's tensors (y is written), then plan afresh from what it found
        searched = plan
        try:
            searched.init_plan()
            # The search gets a copy of its own, compressed against the unused searched plan and freed
            # after: in an earlier measured run the search failed (status 7) on copies made for other plans.
            a = _compress(searched, args.values, args.metadata)
            _run(searched, a, args.x, args.y, _workspace(searched, args.x.device), search=True)
            found = searched.get_alg()
        finally:
            torch.cuda.current_stream(args.x.device).synchronize()  # nothing in flight uses it
            searched.destroy()
        # As a new process would from the stored search: the searched plan's own state after the
        # search does not match copies compressed afresh (see _weight_plan).
        plan = _Plan(key)
        plan.set_alg(found)
        plan.init_plan()
        plan_cache().put(_SEARCH_OP, problem, found, device=f"cuda:{key.device}")
    _plans[key] = plan
    while len(_plans) > _MAX_PLANS:
        _plans.popitem(last=False)[1].destroy()
    return plan


def _padded(n: int) -> int:
    """The N the library runs: the next multiple of 16 (it takes no other N, and no N < 16)."""
    return -(-n // _N_MULTIPLE) * _N_MULTIPLE


def _key(desc) -> _Key:
    index = _device_index(desc.device)
    return _Key(torch.cuda.current_device() if index is None else index, desc.m, desc.k, _padded(desc.n), desc.dtype,
                _fuses_relu(desc))


def _fuses_relu(desc) -> bool:
    """relu goes into the library's epilogue only when no bias has to come before it."""
    return desc.activation == "relu" and not desc.has_bias


def _needs_pass(desc) -> bool:
    return desc.has_bias or (desc.activation is not None and not _fuses_relu(desc))


@functools.lru_cache(maxsize=64)  # a device-string parse would otherwise run on every call
def _device_index(device: str) -> int | None:
    return torch.device(device).index


class CusparseLtSparse24Backend(Backend):
    name = "cusparselt"
    priority = 8

    def supports(self, desc) -> str | None:
        if not desc.device.startswith("cuda"):
            return f"device {desc.device}: cuSPARSELt runs on CUDA devices"
        if (why := ungated(desc, self.name)) is not None:
            return why
        if desc.dtype not in _CUDA_DTYPE:
            return (f"dtype {desc.dtype} is not one of {tuple(_CUDA_DTYPE)} (cuSPARSELt runs f32 as TF32 "
                    f"with 1:2 sparsity, not 2:4)")
        if _needs_pass(desc):
            reason = triton_reason(desc.device)  # the bias/activation pass is a Triton kernel
            if reason is not None:
                return f"bias and activations other than relu need the Triton epilogue pass: {reason}"
        # The library's shape rules for 16-bit 2:4 operands: M and K multiples of 16.  N has the
        # same rule, but run() pads it, so any N goes.
        bad = [f"{name}={v}" for name, v in (("m", desc.m), ("k", desc.k)) if v % 16 or v < 16]
        if bad:
            return (f"cuSPARSELt needs m and k to be multiples of 16 (and at least 16); got {', '.join(bad)}: "
                    f"pad the weight, or take another backend")
        index = _device_index(desc.device)
        if index is None and torch.cuda.is_available():
            index = torch.cuda.current_device()
        if desc.dtype == "f16" and index:
            # Measured with cuSPARSELt 0.8.0 on two H200s: every f16 search on device index 1 failed
            # (status 7, or an illegal memory access that ends the process's CUDA context), with
            # either GPU as index 1 (CUDA_VISIBLE_DEVICES=1,0); the same GPU as index 0 ran, as did
            # bf16 on index 1.
            return (f"dtype f16 on {desc.device} (device index {index}): cuSPARSELt 0.8's search fails for f16 "
                    f"on any device but index 0; run bf16, or make this GPU index 0 with CUDA_VISIBLE_DEVICES")
        return available()

    def priority_for(self, desc) -> int:
        return self.priority if desc.n >= 128 else 2

    def precision(self, desc) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            desc.dtype, "f32", deterministic=True, bit_stable=False,
            note="cuSPARSELt picks its kernel (and split-K) per shape by search, so bits can change with N; "
            "a bias, or an activation other than relu, is applied by one more pass over y after the GEMM "
            "rounded it to the output dtype (fp32 math in the pass)",
        )

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        # cuSPARSELt reads X^T column-major with ld = K from a 16-byte aligned address, and writes
        # Y^T column-major with ld = M, for N a multiple of 16.  Any other x (a transposed or sliced
        # view, or an N off the multiple) is copied into a padded buffer, and y comes back through
        # one.  The pad rows are left unset: column j of Y^T reads only column j of X^T, and the
        # pad columns are dropped, so they cannot reach the result.
        x, y = args.x, args.y
        n = x.shape[0]
        if n == 0:
            return
        n_run = _padded(n)
        if n_run != n or not x.is_contiguous() or x.data_ptr() % _ALIGN:
            x = torch.empty((n_run, x.shape[1]), dtype=x.dtype, device=x.device)
            x[:n].copy_(args.x)
        if n_run != n or not y.is_contiguous() or y.data_ptr() % _ALIGN:
            y = torch.empty((n_run, y.shape[1]), dtype=y.dtype, device=y.device)
        args_here = GemmSparse24Args(x, args.values, args.metadata, y, args.bias)
        own, a = _weight_plan(plan_for(_key(desc), args_here), args.values, args.metadata)
        _run(own, a, x, y, _workspace(own, x.device), search=False)
        if _needs_pass(desc):
            from ..kernels.sparse24 import bias_act_

            bias_act_(y, args.bias, None if _fuses_relu(desc) else desc.activation)
        if y is not args.y:
            args.y.copy_(y[:n])
