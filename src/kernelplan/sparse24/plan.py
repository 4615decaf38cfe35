"""The 2:4 GEMM's plan level: ``Y[N, M] = X[N, K] @ W^T (+ bias) -> activation``, W in the 2:4 format.

The descriptor and args, the plan (its dispatch: the rule of ``dispatch.py`` under
memory="compact", measurements under "fast"), and the reference backend.  The GPU
backends register themselves from ``backends.py``, the "fast" policy's timing is
``tuning.py``, and the functional and autograd layer is ``gemm.py``: each of them
imports this module, and this module none of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._checks import check_dims, check_no_internal_overlap, check_no_overlap, check_tensor, choice, warn_once
from ..activations import ACTIVATIONS, GATED_EPILOGUES, epilogue_columns
from ..dtypes import dtype_info
from ..errors import InvalidProblem, MisalignedOperand
from ..plan import Backend, BackendRegistry, Plan, PrecisionGuarantee
from .dispatch import MEMORY_POLICIES, backend_for
from .format import SPARSE24_DTYPES, Sparse24Weight
from .layout import PUBLIC, SP_LAYOUT

SPARSE24_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "quick_gelu")
# An activation, or a gated epilogue (activations.GATED_EPILOGUES: y has M / 2 columns, act(gate) * other).
SPARSE24_EPILOGUES = SPARSE24_ACTIVATIONS + tuple(GATED_EPILOGUES)


def epilogue_fn(epilogue: str | None):
    """The epilogue as a function of the pre-activation z [..., M], in torch (the reference's, autograd's)."""
    gated = GATED_EPILOGUES.get(epilogue)
    return gated.fn if gated is not None else ACTIVATIONS[epilogue or "identity"].fn


def ungated(desc: "GemmSparse24Descriptor", backend: str) -> str | None:
    """The reason a backend without the gated epilogue gives (only ``cuda_ws``, ``cuda_sp`` and the reference have
    it), or None."""
    if desc.activation in GATED_EPILOGUES:
        return (f"the gated epilogue {desc.activation!r} is in the one layout's kernels (cuda_ws, cuda_sp) and the "
                f"reference, not {backend}")
    return None


def gated_reason(m: int) -> str | None:
    """Why a weight of ``m`` rows cannot take a gated epilogue, or None: its halves are whole 16-row tiles."""
    return None if m % 32 == 0 else f"M = {m} rows is not two halves of whole 16-row tiles (M % 32 == 0)"


@dataclass(frozen=True)
class GemmSparse24Descriptor:
    n: int  # rows of X and Y (tokens)
    m: int  # rows of W, columns of Y (output features)
    k: int  # columns of X and W (input features); a multiple of 8
    dtype: str  # short dtype name, see kernelplan.dtypes
    activation: str | None = None  # or a gated epilogue (SPARSE24_EPILOGUES): y is then [N, M / 2]
    has_bias: bool = False
    device: str = "cpu"
    # Recorded into a CUDA graph: replays cost no host time, so dispatch picks by kernel time alone.
    graph: bool = False
    # "compact": the one device layout's kernels, chosen by rule (sparse24/dispatch.py); "fast": every
    # backend, each with its own copy of the weight, timed at the first call of each N bucket.
    memory: str = "compact"


@dataclass
class GemmSparse24Args:
    x: torch.Tensor  # [N, K]
    values: torch.Tensor  # [M, K/2]
    metadata: torch.Tensor  # [M, K/8] int16
    y: torch.Tensor  # [N, M], written ([N, M / 2] under a gated epilogue)
    bias: torch.Tensor | None = None  # [M]


def rule_backend(desc: GemmSparse24Descriptor) -> str:
    """``dispatch.backend_for`` of a descriptor: the device's compute capability looked up (memoised)."""
    device = torch.device(desc.device)
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
    return backend_for(capability, desc.n, desc.m, desc.k, desc.dtype)


@functools.lru_cache(maxsize=64)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def n_bucket(n: int) -> int:
    """Dispatch measures per power-of-two bucket of N: 1, 2, 4, ..., 8192, ..."""
    return 1 << max(n - 1, 0).bit_length()


class GemmSparse24Plan(Plan):
    op = "sparse24_gemm"
    registry = BackendRegistry(op)

    @classmethod
    def dispatch_key(cls, desc: GemmSparse24Descriptor) -> dict:
        return {**super().dispatch_key(desc), "n": n_bucket(desc.n)}

    @classmethod
    def check_descriptor(cls, desc: GemmSparse24Descriptor) -> None:
        check_dims(desc, ("n", "m", "k"))
        if desc.k % 8:
            raise MisalignedOperand(
                f"descriptor.k is {desc.k}; 2:4 GEMM needs K % 8 == 0: pad K to "
                f"{-(-desc.k // 8) * 8} with zero columns"
            )
        dtype_info(desc.dtype, "descriptor.dtype")
        if desc.activation is not None:
            choice(desc.activation, "descriptor.activation", SPARSE24_EPILOGUES)
            why = gated_reason(desc.m) if desc.activation in GATED_EPILOGUES else None
            if why is not None:
                raise InvalidProblem(f"descriptor.activation is the gated epilogue {desc.activation!r} but {why}; "
                                     f"pad each half to a multiple of 16 rows")
        choice(desc.memory, "descriptor.memory", MEMORY_POLICIES)

    @classmethod
    def _choose(cls, desc: GemmSparse24Descriptor, candidates: list[Backend]) -> Backend:
        """``compact``: the backend ``dispatch.backend_for`` names; ``fast``: the measured or preferred one."""
        if desc.memory == "fast":
            return super()._choose(desc, candidates)
        name = rule_backend(desc)
        for backend in candidates:
            if backend.name == name:
                return backend
        if len(candidates) == 1:  # a backend asked for by name (PlanPreference.only)
            return candidates[0]
        chosen = cls.registry.get(name)
        reason = chosen.supports(desc) if chosen is not None else "not registered"
        warn_once(f"2:4 linear {desc}: the rule's backend {name} cannot run it ({reason}); the reference "
                   f"runs it instead, decompressing the weight at every call. memory='fast' lets every "
                   f"backend compete")
        return cls.registry.get("reference")

    def check_args(self, args: GemmSparse24Args) -> None:
        d = self.desc
        dtype = dtype_info(d.dtype).dtype
        check_tensor(args.x, "x", shape=(d.n, d.k), dtype=dtype, device=d.device)
        check_tensor(args.values, "values", shape=(d.m, d.k // 2), dtype=dtype, device=d.device)
        check_tensor(args.metadata, "metadata", shape=(d.m, d.k // 8), dtype=torch.int16, device=d.device)
        check_tensor(args.y, "y", shape=(d.n, epilogue_columns(d.m, d.activation)), dtype=dtype, device=d.device,
                     output=True)
        check_no_internal_overlap(args.y, "y")
        if d.has_bias != (args.bias is not None):
            raise InvalidProblem(
                f"bias is {'given' if args.bias is not None else 'None'} but the descriptor says "
                f"has_bias={d.has_bias}; select a plan whose descriptor matches the call"
            )
        if args.bias is not None:
            check_tensor(args.bias, "bias", shape=(d.m,), dtype=dtype, device=d.device)
        check_no_overlap(args.y, "y", {"x": args.x, "values": args.values, "bias": args.bias})


class ReferenceSparse24Backend(Backend):
    """Decompress, then one matmul in fp32 (fp64 for fp64): exact semantics, any device, either layout."""

    name = "reference"
    priority = 0
    layouts = (PUBLIC, SP_LAYOUT)  # the weight layouts run reads as they are; others get the public format

    def supports(self, desc: GemmSparse24Descriptor) -> str | None:
        if desc.dtype not in SPARSE24_DTYPES:
            return f"dtype {desc.dtype} is not one of {SPARSE24_DTYPES}"
        return None

    def precision(self, desc) -> PrecisionGuarantee:
        compute = dtype_info(desc.dtype).compute
        name = dtype_info(compute).name
        # BLAS picks its blocking by shape and thread count, so bits may change with N.
        return PrecisionGuarantee(name, name, deterministic=True, bit_stable=False)

    def run(self, desc, args: GemmSparse24Args, workspace) -> None:
        compute = dtype_info(desc.dtype).compute
        w = Sparse24Weight(args.values.to(compute), args.metadata, k=args.x.shape[-1], _validate=False).decompress()
        z = args.x.to(compute) @ w.T
        if args.bias is not None:
            z += args.bias.to(compute)
        args.y.copy_(epilogue_fn(desc.activation)(z))


GemmSparse24Plan.registry.register(ReferenceSparse24Backend())
