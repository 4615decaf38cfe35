"""The cuBLASLt GEMM backend, through nvmath-python's ``cublasLt`` bindings.

**The transposed product.**  cuBLASLt is column-major and adds its bias per
row of D; nn.Linear adds it per output feature, a column of our row-major
``D [m, n]``.  So the backend plans ``D^T [n, m] = op(B)^T [n, k] @ op(A)^T
[k, m]``: a row-major ``D`` *is* a column-major ``D^T``, ``w [n, k]`` is
read with op T, ``x [m, k]`` as it lies, and the bias lands on each output
feature.  Nothing is copied for the nn.Linear layouts.  In those terms our
``BGRAD`` (row sums of ``op(A)``) is cuBLASLt's ``BGRADB``, and ``D*_BGRAD``
gives the bias gradient per output feature.

**Aux.**  GELU aux is D^T's shape in D's dtype with a leading dimension that
is a multiple of 8: an ``aux [m, n]`` whose row stride is such a multiple is
written in place, any other goes through a padded buffer.  ReLU aux is a
bitmask in cuBLASLt (bit ``j`` of byte ``i`` in column ``c`` is element ``8i
+ j``, 16-byte padded) and our contract is a bool mask, so RELU_AUX unpacks
it and DRELU packs it: two small passes over ``m * n / 8`` bytes.

**Why the bindings, not ``nvmath.linalg.advanced.Matmul``.**  Measured on an
H200 (torch 2.11, nvmath-python 1.0.0, cuBLASLt 13.1), bf16 16x4096->4096 with
a bias: ``Matmul.reset_operands_unchecked`` + ``execute`` costs 27 µs of host
time per call in place and 53 µs out of place, against 13.9 µs for
``F.linear``.  Its ``execute`` allocates every aux output itself, so aux could
not be written into the caller's buffer either.  Here a call is a dict
lookup, up to three pointer attributes and ``cublasLtMatmul``.

**Workspace.**  ``workspace_size`` is 0: by default the backend keeps one buffer per
stream (launches on a stream are ordered, so it is reused safely) and a fresh one
inside graph capture.  A workspace passed to ``plan.run`` is used instead, as a
hint; one smaller than the chosen algorithm needs is ``WorkspaceTooSmall``.

**Plans** (descriptors, layouts, algorithm) are cached per (device, dtype,
epilogue, layouts, pointer alignments) in a bounded LRU.  The first call of
a key times up to ``_CANDIDATES`` heuristic algorithms on the caller's
tensors and stores the fastest in the plan cache (keyed with the cuBLASLt
version), so a new process takes it without timing again.  Calls run on the
caller's current torch stream, read at call time; under CUDA graph capture
the heuristic's first choice runs untimed.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .._checks import same_device
from ..errors import InvalidProblem, Unsupported, WorkspaceTooSmall
from ..kernels import current_device, raw_stream as _raw_stream, stream_capturing
from ..plan import Backend, PrecisionGuarantee
from .epilogue import Epilogue
from .plan import GemmArgs, GemmDescriptor, GemmPlan

_MAX_PLANS = 256
_MAX_ROUTES = 4096
_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends on Hopper
_CANDIDATES = 8
_TUNE_OP = "cublaslt_algo_v2"  # v2: short problems timed over 30 calls, ties to the heuristic

# Our epilogue -> cuBLASLt's, in the transposed product.
_EPILOGUES = {
    Epilogue.NONE: "DEFAULT", Epilogue.BIAS: "BIAS",
    Epilogue.RELU: "RELU", Epilogue.RELU_BIAS: "RELU_BIAS",
    Epilogue.GELU: "GELU", Epilogue.GELU_BIAS: "GELU_BIAS",
    Epilogue.RELU_AUX: "RELU_AUX", Epilogue.RELU_AUX_BIAS: "RELU_AUX_BIAS",
    Epilogue.GELU_AUX: "GELU_AUX", Epilogue.GELU_AUX_BIAS: "GELU_AUX_BIAS",
    Epilogue.DRELU: "DRELU", Epilogue.DRELU_BGRAD: "DRELU_BGRAD",
    Epilogue.DGELU: "DGELU", Epilogue.DGELU_BGRAD: "DGELU_BGRAD",
    Epilogue.BGRAD: "BGRADB",
}

# dtype -> (CUDA data type, compute type, numpy type of alpha and beta)
_TYPES = {
    "f64": ("CUDA_R_64F", "COMPUTE_64F", np.float64),
    "f32": ("CUDA_R_32F", "COMPUTE_32F", np.float32),
    "f16": ("CUDA_R_16F", "COMPUTE_32F", np.float32),
    "bf16": ("CUDA_R_16BF", "COMPUTE_32F", np.float32),
}


def _lt():
    from nvmath.bindings import cublasLt

    return cublasLt


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None if nvmath-python's cuBLASLt bindings load, else why not."""
    try:
        _lt().get_version()
    except Exception as e:  # ImportError, or the library itself failing to load
        return f"nvmath-python's cuBLASLt bindings are unavailable ({type(e).__name__}: {e}): pip install nvmath-python"
    return None


@functools.lru_cache(maxsize=None)
def _handle(index: int) -> int:
    with torch.cuda.device(index):
        return _lt().create()


def _set(setter, obj, attr_enum, name: str, value) -> np.ndarray:
    """Set attribute ``name`` of a cuBLASLt object; returns the buffer (cuBLASLt copies it)."""
    attr = attr_enum[name]
    buf = np.array([value], dtype=_attr_dtype(attr_enum, attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)
    return buf


@functools.lru_cache(maxsize=None)
def _attr_dtype(attr_enum, attr):
    lt = _lt()
    getter = {
        lt.MatmulDescAttribute: lt.get_matmul_desc_attribute_dtype,
        lt.MatmulPreferenceAttribute: lt.get_matmul_preference_attribute_dtype,
    }[attr_enum]
    return getter(attr)


@dataclass(frozen=True)
class _Layout:
    """A matrix as cuBLASLt stores it: column-major ``rows x cols`` with ``ld``; ``trans`` means op T."""

    rows: int
    cols: int
    ld: int
    trans: bool = False


def _operand(v: torch.Tensor, trans_first: bool = False) -> tuple[_Layout, torch.Tensor]:
    """``v`` (logically ``[r, c]``) as a cuBLASLt operand; copied only when neither dim has unit stride.

    A vector is both row- and column-major; ``trans_first`` takes the row-major (op T) reading then.
    """
    r, c = v.shape
    s0, s1 = v.stride()
    # A size-1 dim's stride means nothing: a vector is both row- and column-major.
    col = (s0 == 1 or r == 1) and (c == 1 or s1 >= r)
    row = (s1 == 1 or c == 1) and (r == 1 or s0 >= c)
    if col and not (row and trans_first):
        return _Layout(r, c, max(s1, r, 1)), v
    if row:
        return _Layout(c, r, max(s0, c, 1), trans=True), v
    v = v.contiguous()
    return _Layout(c, r, max(c, 1), trans=True), v


def _column_major(t: torch.Tensor) -> _Layout | None:
    """The layout of ``t^T`` when ``t [m, n]`` can be D or C as it is (unit stride along n), else None."""
    m, n = t.shape
    if (t.stride(1) == 1 or n == 1) and (m == 1 or t.stride(0) >= n):
        return _Layout(n, m, max(t.stride(0), n, 1))
    return None


def _alignment(t: torch.Tensor) -> int:
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _relu_mask_bytes(n: int) -> int:
    """Bytes per column of D^T in cuBLASLt's ReLU bitmask: one bit per element, padded to 16 bytes."""
    return _round_up(-(-n // 8), 16)


_BITS = {}


def _bits(device) -> torch.Tensor:
    t = _BITS.get(device)
    if t is None:
        t = _BITS[device] = 1 << torch.arange(8, dtype=torch.uint8, device=device)
    return t


def _unpack_relu(mask: torch.Tensor, out: torch.Tensor) -> None:
    """cuBLASLt's bitmask ``[m, bytes]`` -> our bool ``out [m, n]``."""
    m, n = out.shape
    bits = (mask.unsqueeze(-1) & _bits(mask.device)) != 0
    out.copy_(bits.reshape(m, -1)[:, :n])


def _pack_relu(aux: torch.Tensor) -> torch.Tensor:
    """Our bool ``aux [m, n]`` -> cuBLASLt's bitmask ``[m, bytes]`` (uint8, pad bits 0)."""
    m, n = aux.shape
    width = _relu_mask_bytes(n) * 8
    padded = torch.zeros((m, width), dtype=torch.uint8, device=aux.device)
    padded[:, :n] = aux
    return (padded.reshape(m, -1, 8) * _bits(aux.device)).sum(-1, dtype=torch.uint8)


@dataclass(frozen=True)
class _Key:
    device: int
    dtype: str
    epilogue: str
    a: _Layout  # op(B)^T
    b: _Layout  # op(A)^T
    c: _Layout | None
    d: _Layout
    aux_ld: int | None
    align: tuple[int, ...]  # of A', B', C, D


class _Plan:
    """Descriptors, layouts and chosen algorithm of one key; a lock guards the per-call pointer attributes."""

    def __init__(self, key: _Key):
        lt = _lt()
        from nvmath import CudaDataType
        from nvmath.bindings import cublas

        self.key = key
        dt_name, compute_name, scale_np = _TYPES[key.dtype]
        dt = CudaDataType[dt_name]
        self.alpha = np.zeros(1, dtype=scale_np)
        self.beta = np.zeros(1, dtype=scale_np)
        # Host addresses, taken once: numpy's .ctypes costs about a microsecond per access.
        self.alpha_ptr, self.beta_ptr = self.alpha.ctypes.data, self.beta.ctypes.data
        self.unit = np.array([1, 0], dtype=scale_np)  # alpha = 1 and beta = 0, for the bound call
        self.one_ptr, self.zero_ptr = self.unit.ctypes.data, self.unit.ctypes.data + self.unit.itemsize
        self.pointer = np.zeros(1, dtype=np.uint64)  # staging for the per-call bias / aux pointers
        self.pointer_ptr = self.pointer.ctypes.data
        self.bias_set = None  # the bias pointer the descriptor holds now: a repeated bias is not set again
        self.handle = _handle(key.device)
        self.lock = threading.Lock()
        self.tuned = False
        self.alive = True  # False once destroyed: a bound call holding it plans again
        self.desc = lt.matmul_desc_create(cublas.ComputeType[compute_name], CudaDataType[
            "CUDA_R_64F" if key.dtype == "f64" else "CUDA_R_32F"])
        self.layouts = []
        self.pref = None
        desc_attr = lt.MatmulDescAttribute
        op = lambda t: cublas.Operation.T if t else cublas.Operation.N  # noqa: E731
        setd = functools.partial(_set, lt.matmul_desc_set_attribute, self.desc, desc_attr)
        setd("TRANSA", op(key.a.trans))
        setd("TRANSB", op(key.b.trans))
        setd("EPILOGUE", lt.Epilogue[_EPILOGUES[Epilogue(key.epilogue)]])
        if key.aux_ld is not None:
            setd("EPILOGUE_AUX_LD", key.aux_ld)
            setd("EPILOGUE_AUX_POINTER", 1)  # a placeholder: the heuristic refuses a null aux pointer
        layout = lambda lay: lt.matrix_layout_create(dt, lay.rows, lay.cols, lay.ld)  # noqa: E731
        self.layouts = [layout(key.a), layout(key.b), layout(key.c or key.d), layout(key.d)]
        self.pref = lt.matmul_preference_create()
        setp = functools.partial(_set, lt.matmul_preference_set_attribute, self.pref, lt.MatmulPreferenceAttribute)
        setp("MAX_WORKSPACE_BYTES", _WORKSPACE_BYTES)
        for name, align in zip("ABCD", key.align):
            setp(f"MIN_ALIGNMENT_{name}_BYTES", align)
        self.results = np.zeros(_CANDIDATES, dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(_handle(key.device), self.desc, *self.layouts, self.pref, _CANDIDATES,
                                     self.results.ctypes.data, count.ctypes.data)
        self.results = self.results[: int(count[0])]
        if len(self.results) == 0:
            raise Unsupported(f"cuBLASLt has no algorithm for {key}")
        self.choose(0)

    def choose(self, i: int) -> None:
        self.algo = np.array(self.results["algo"][i])  # a contiguous copy, for its pointer
        self.algo_ptr = self.algo.ctypes.data
        self.workspace = int(self.results["workspace_size"][i])

    def algo_hex(self, i: int) -> str:
        return self.results["algo"][i].tobytes().hex()

    def destroy(self) -> None:
        self.alive = False
        lt = _lt()
        if self.pref is not None:
            lt.matmul_preference_destroy(self.pref)
        for lay in self.layouts:
            lt.matrix_layout_destroy(lay)
        lt.matmul_desc_destroy(self.desc)


_plans: "OrderedDict[_Key, _Plan]" = OrderedDict()
_plans_lock = threading.Lock()


def release_plans() -> None:
    """Destroy every cached cuBLASLt plan of this process; the next call plans again (no re-timing)."""
    with _plans_lock:
        _routes.clear()
        while _plans:
            _plans.popitem()[1].destroy()


def _problem(key: _Key) -> dict:
    from dataclasses import asdict

    problem = asdict(key)
    del problem["device"]  # the plan cache keys on the device itself
    return {"cublaslt": _lt().get_version(), **problem}


class CublasLtGemmBackend(Backend):
    name = "cublaslt"
    priority = 20

    def supports(self, desc: GemmDescriptor) -> str | None:
        if not desc.device.startswith("cuda"):
            return "cuBLASLt runs on CUDA devices only"
        if desc.dtype not in _TYPES:
            return f"dtype {desc.dtype}: this backend takes f64, f32, f16 and bf16 (fp8 runs on scaled_mm)"
        spec = Epilogue.parse(desc.epilogue).spec
        if desc.dtype == "f64" and "gelu_tanh" in (spec.activation, spec.aux_in):
            return ("f64 GELU: cuBLASLt evaluates GELU in fp32 (measured 8e-11 relative error in f64 on an "
                    "H200), short of f64; the reference backend runs it")
        return available()

    def precision(self, desc: GemmDescriptor) -> PrecisionGuarantee:
        spec = Epilogue.parse(desc.epilogue).spec
        gelu = "gelu_tanh" in (spec.activation, spec.aux_in)
        note = ("cuBLASLt; GELU is the tanh approximation, evaluated in fp32 to ~1e-5 relative error "
                "(measured up to 4.9e-6 on an H200), not to f32 rounding") if gelu else "cuBLASLt"
        acc = "f64" if desc.dtype == "f64" else "f32"
        return PrecisionGuarantee(acc, acc, deterministic=True, bit_stable=False, note=note)

    def bind(self, desc: GemmDescriptor):
        """The plain linear (NONE or BIAS, nn.Linear layouts): a route lookup and ``cublasLtMatmul``.

        ``linear()``'s inference fast path calls it for a repeated call it has
        checked once.  The route (plan and algorithm) is kept per strides and
        pointer alignments of x and w; a layout ``run`` would copy, a bias it
        would copy, and a call that still tunes all go through ``run``.
        """
        if (Epilogue(desc.epilogue) not in (Epilogue.NONE, Epilogue.BIAS) or desc.has_c or desc.transa
                or not desc.transb or desc.dtype not in _TYPES or desc.b_dtype not in (None, desc.dtype)
                or desc.d_dtype != desc.dtype):
            return None
        m, n = desc.m, desc.n
        index = torch.device(desc.device).index
        if index is None:
            return None  # a descriptor of "cuda" means whichever device is current: run() resolves it
        # (x strides, w strides, x and w alignment) -> the plan's launch arguments, unpacked once
        routes: dict = {}
        lt = _lt()
        bias_attr = _pointer_attrs()[0]
        run = self.run

        def call(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if current_device() != index:  # cuBLASLt launches into the current device's context
                with torch.cuda.device(index):
                    return call(x2, w, bias)
            d = x2.new_empty((m, n))  # D has x's dtype here, and new_empty is the cheapest allocation
            if bias is not None and (bias.stride(0) != 1 or bias.data_ptr() & 15):
                run(desc, GemmArgs(x2, w, d, bias=bias), None)  # run copies such a bias; nothing to route
                return d
            px, pw = x2.data_ptr(), w.data_ptr()
            key = (x2.stride(), w.stride(), px & 255, pw & 255)
            route = routes.get(key)
            if route is None or not route[0].alive:
                run(desc, GemmArgs(x2, w, d, bias=bias), None)
                plan, copy_a, copy_b, _, _, _ = _route(desc, w, x2.T, None, d, None)
                if plan.tuned and not (copy_a or copy_b):
                    routes[key] = (plan, plan.handle, plan.desc, *plan.layouts, plan.algo_ptr, plan.workspace,
                                   plan.one_ptr, plan.zero_ptr, plan.key.device)
                return d
            plan, handle, mdesc, la, lb, lc, ld, algo, ws_bytes, one, zero, device = route
            stream = _raw_stream(device)
            ws = _workspace(ws_bytes, stream, device).data_ptr() if ws_bytes else 0
            pd = d.data_ptr()
            if bias is None:
                # A NONE plan's descriptor is never changed by a call (no bias, no aux): no lock to take.
                lt.matmul(handle, mdesc, one, pw, la, px, lb, zero, pd, lc, pd, ld, algo, ws, ws_bytes, stream)
                return d
            bp = bias.data_ptr()
            with plan.lock:
                if plan.bias_set != bp:  # inference passes the same bias every call: set once
                    plan.pointer[0] = plan.bias_set = bp
                    lt.matmul_desc_set_attribute(mdesc, bias_attr, plan.pointer_ptr, 8)
                lt.matmul(handle, mdesc, one, pw, la, px, lb, zero, pd, lc, pd, ld, algo, ws, ws_bytes, stream)
            return d

        return call

    def run(self, desc: GemmDescriptor, args: GemmArgs, workspace) -> None:
        op_a = args.a.T if desc.transa else args.a  # [m, k]
        op_b = args.b.T if desc.transb else args.b  # [k, n]
        a, b, d, c = op_b.T, op_a.T, args.d, args.c  # A' = op(B)^T [n, k], B' = op(A)^T [k, m]
        # Everything the plan depends on besides desc: strides and pointer alignments.
        shape_key = (desc, a.stride(), b.stride(), d.stride(), None if c is None else c.stride(),
                     None if args.aux is None else (args.aux.stride(), args.aux.data_ptr() & 255),
                     a.data_ptr() & 255, b.data_ptr() & 255, d.data_ptr() & 255, 0 if c is None else c.data_ptr() & 255)
        route = _routes.get(shape_key)
        if route is None:
            if len(_routes) >= _MAX_ROUTES:
                _routes.clear()
            route = _routes[shape_key] = _route(desc, a, b, c, d, args.aux)
        plan, copy_a, copy_b, copy_c, temp_d, aux_mode = route
        if copy_a:
            a = a.contiguous()
        if copy_b:
            b = b.contiguous()
        if copy_c:
            c = c.contiguous()
        if temp_d:
            d = torch.empty((desc.m, desc.n), dtype=d.dtype, device=d.device)
        aux = _aux_in(aux_mode, args.aux, desc)
        bias = args.bias
        if bias is not None and (bias.stride(0) != 1 or bias.data_ptr() % 16):
            bias = bias.contiguous() if bias.stride(0) != 1 else bias.clone()
        bgrad = args.bgrad
        if bgrad is not None and (bgrad.stride(0) != 1 or bgrad.data_ptr() % 16):
            bgrad = torch.empty(bgrad.shape, dtype=bgrad.dtype, device=bgrad.device)
        if workspace is not None and not same_device(workspace.device, desc.device):
            raise InvalidProblem(
                f"workspace is on {workspace.device} but the plan runs on {desc.device}; allocate the "
                f"workspace on {desc.device}, or pass workspace=None to use the backend's own"
            )
        if workspace is not None and workspace.numel() * workspace.element_size() < plan.workspace:
            raise WorkspaceTooSmall(
                plan.workspace, workspace.numel() * workspace.element_size(),
                fix="the cuBLASLt algorithm chosen for this problem needs {needed} bytes: pass at least "
                    "that, or workspace=None to use the backend's own",
            )
        call = functools.partial(_launch, plan, a, b, c, d, bias, aux, bgrad, args.alpha,
                                 args.beta if c is not None else 0.0, _raw_stream(plan.key.device), workspace)
        if not plan.tuned:
            _tune(plan, call, torch.cuda.current_stream(plan.key.device))
        call()
        if d is not args.d:
            args.d.copy_(d)
        if bgrad is not args.bgrad:
            args.bgrad.copy_(bgrad)
        if aux_mode == "relu_out":
            _unpack_relu(aux, args.aux)
        elif aux_mode == "gelu_out_padded":
            args.aux.copy_(aux[:, : desc.n])


_routes: dict = {}  # (desc, strides, alignments) -> (plan, copies, aux mode); plans drop out with release_plans


def _route(desc, a, b, c, d, aux):
    """The plan of a call and which operands it copies: the slow half of ``run``, once per layout."""
    spec = Epilogue.parse(desc.epilogue).spec
    # BGRADB takes B' with op T only: that is B' stored row-major.
    copy_b = spec.bgrad == "a" and not ((b.stride(1) == 1 or b.shape[1] == 1)
                                        and (b.shape[0] == 1 or b.stride(0) >= b.shape[1]))
    la, a2 = _operand(a)
    lb, b2 = _operand(b.contiguous() if copy_b else b, trans_first=spec.bgrad == "a")
    copy_b = copy_b or b2 is not b
    ld_ = _column_major(d)
    temp_d = ld_ is None
    if temp_d:
        ld_ = _Layout(desc.n, desc.m, max(desc.n, 1))
    lc, copy_c = None, False
    if c is not None:
        lc = _column_major(c)
        copy_c = lc is None
        if copy_c:
            lc = _Layout(desc.n, desc.m, max(desc.n, 1))
    aux_mode, aux_ld = _aux_mode(spec, aux, desc)
    align = lambda t, copied: 256 if copied else _alignment(t)  # noqa: E731  (fresh copies are 256-aligned)
    key = _Key(d.device.index if d.device.index is not None else torch.cuda.current_device(),
               desc.dtype, desc.epilogue, la, lb, lc, ld_, aux_ld,
               (align(a, a2 is not a), align(b, copy_b), align(c, copy_c) if c is not None else align(d, temp_d),
                align(d, temp_d)))
    return _plan_for(key), a2 is not a, copy_b, copy_c, temp_d, aux_mode


def _aux_mode(spec, aux: torch.Tensor | None, desc) -> tuple[str | None, int | None]:
    """How aux reaches cuBLASLt, and its leading dimension there."""
    act = spec.aux_activation
    if act is None:
        return None, None
    if act == "relu":
        return ("relu_in" if spec.aux_in else "relu_out"), _relu_mask_bytes(desc.n) * 8
    lay = _column_major(aux)
    if lay is not None and lay.ld % 8 == 0 and _alignment(aux) >= 16:
        return "gelu", lay.ld
    return ("gelu_in_padded" if spec.aux_in else "gelu_out_padded"), _round_up(desc.n, 8)


def _aux_in(mode: str | None, aux: torch.Tensor | None, desc) -> torch.Tensor | None:
    """The buffer cuBLASLt reads or writes as aux (the caller's own where its layout allows)."""
    if mode is None or mode == "gelu":
        return aux
    if mode == "relu_in":
        return _pack_relu(aux)
    if mode == "relu_out":
        return torch.empty((desc.m, _relu_mask_bytes(desc.n)), dtype=torch.uint8, device=aux.device)
    buf = torch.empty((desc.m, _round_up(desc.n, 8)), dtype=aux.dtype, device=aux.device)
    if mode == "gelu_in_padded":
        buf[:, : desc.n].copy_(aux)
    return buf


def _plan_for(key: _Key) -> _Plan:
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    try:
        plan = _Plan(key)
    except _lt().cuBLASLtError as e:
        raise Unsupported(
            f"cuBLASLt cannot plan this GEMM ({e}): {key}; select the reference backend with "
            f"PlanPreference.only('reference')"
        ) from e
    from ..cache import plan_cache

    stored = plan_cache().get(_TUNE_OP, _problem(key), device=f"cuda:{key.device}")
    if stored is not None:
        for i in range(len(plan.results)):
            if plan.algo_hex(i) == stored:
                plan.choose(i)
                plan.tuned = True
                break
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > _MAX_PLANS:
            _routes.clear()  # routes hold plans: rebuilt on their next call
            _plans.popitem(last=False)[1].destroy()
    return plan


_workspaces: dict = {}  # cudaStream_t -> a uint8 buffer, reused: launches on one stream are ordered


def _workspace(nbytes: int, stream: int, device: int) -> torch.Tensor | None:
    if nbytes == 0:
        return None
    # Nothing is captured on the legacy default stream (handle 0: CUDA refuses to capture it), and
    # most eager work runs there: the capture query (0.8 us of host time on an H100 host) is skipped.
    if stream and stream_capturing():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # the graph's pool keeps it
    ws = _workspaces.get(stream)  # stream handles are unique across devices
    if ws is None or ws.numel() < nbytes:
        ws = _workspaces[stream] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
    return ws


@functools.lru_cache(maxsize=1)
def _pointer_attrs() -> tuple[int, int]:
    attrs = _lt().MatmulDescAttribute
    return int(attrs.BIAS_POINTER), int(attrs.EPILOGUE_AUX_POINTER)


def _launch(plan: _Plan, a, b, c, d, bias, aux, bgrad, alpha, beta, stream: int, given=None) -> None:
    lt = _lt()
    ws = given if given is not None and plan.workspace else _workspace(plan.workspace, stream, plan.key.device)
    bias_attr, aux_attr = _pointer_attrs()
    with plan.lock:
        plan.alpha[0], plan.beta[0] = alpha, beta
        if bias is not None or bgrad is not None:
            plan.pointer[0] = plan.bias_set = (bias if bias is not None else bgrad).data_ptr()
            lt.matmul_desc_set_attribute(plan.desc, bias_attr, plan.pointer_ptr, 8)
        if aux is not None:
            plan.pointer[0] = aux.data_ptr()
            lt.matmul_desc_set_attribute(plan.desc, aux_attr, plan.pointer_ptr, 8)
        lt.matmul(plan.handle, plan.desc, plan.alpha_ptr, a.data_ptr(), plan.layouts[0],
                  b.data_ptr(), plan.layouts[1], plan.beta_ptr, (c if c is not None else d).data_ptr(),
                  plan.layouts[2], d.data_ptr(), plan.layouts[3], plan.algo_ptr,
                  ws.data_ptr() if ws is not None else 0, plan.workspace, stream)


def _tune(plan: _Plan, call, stream) -> None:
    """Time each heuristic candidate on the caller's tensors and keep the fastest, in the plan cache too.

    Ties go to the heuristic's order: the first candidate within ``_TIE`` of the best wins.
    """
    from ..cache import plan_cache

    if len(plan.results) == 1 or stream_capturing():
        plan.tuned = len(plan.results) == 1
        return
    times = []
    for i in range(len(plan.results)):
        plan.choose(i)
        try:
            call()  # warm-up
        except _lt().cuBLASLtError:
            times.append(float("inf"))  # a candidate the heuristic offered but the launch refuses
            continue
        per_call = _time_calls(call, stream, 3)
        if per_call < _SHORT_MS:
            per_call = _time_calls(call, stream, 30)
        times.append(per_call)
    fastest = min(times)
    best = next(i for i, t in enumerate(times) if t <= fastest * (1 + _TIE))
    plan.choose(best)
    plan.tuned = True
    plan_cache().put(_TUNE_OP, _problem(plan.key), plan.algo_hex(best), device=f"cuda:{plan.key.device}")


# Three calls time a long GEMM well, but a short one's three are within noise of each other and
# of the host's own time: on an H200, 16x4096 -> 4096 bf16, three calls picked a split-K
# candidate that runs at 23.5 us per call back to back, against 14.2 us for the heuristic's first.
_SHORT_MS = 0.05
_TIE = 0.02


def _time_calls(call, stream, calls: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls on ``stream``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(calls):
        call()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / calls


GemmPlan.registry.register(CublasLtGemmBackend())
