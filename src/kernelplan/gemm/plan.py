"""GEMM with fused epilogue: descriptor, args, plan and the reference backend.

``D[m, n] = epilogue(alpha * op(A)[m, k] @ op(B)[k, n] + beta * C[m, n])``,
row-major, with ``op(X) = X^T`` when ``transa`` / ``transb`` is set.  An
nn.Linear ``x @ w^T`` is ``A = x``, ``B = w``, ``transb=True``; its bias is
``bias[n]``.  The epilogues are documented in :mod:`kernelplan.gemm.epilogue`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import check_dims, check_no_overlap, check_tensor
from ..activations import ACTIVATIONS
from ..dtypes import FLOAT_DTYPES, FP8_DTYPES, dtype_info
from ..errors import InvalidProblem, MisalignedOperand
from ..plan import Backend, BackendRegistry, Plan, PrecisionGuarantee
from .epilogue import Epilogue, ScaleSet

FP8_OUT_DTYPES = ("f32", "f16", "bf16") + FP8_DTYPES
FP8_ALIGN = 16  # cuBLASLt's rule for fp8 k and n, which torch._scaled_mm inherits


@dataclass(frozen=True)
class GemmDescriptor:
    m: int
    n: int
    k: int
    dtype: str  # dtype of A (and of everything, unless A is fp8)
    b_dtype: str | None = None  # defaults to dtype; may differ only between fp8 formats
    out_dtype: str | None = None  # defaults to dtype; fp8 inputs may give f32/f16/bf16/fp8
    epilogue: str = "none"
    transa: bool = False
    transb: bool = False
    has_c: bool = False
    scale_a: str = "none"  # none | tensor | vector ([m])
    scale_b: str = "none"  # none | tensor | vector ([n])
    scale_out: bool = False
    amax: bool = False
    device: str = "cpu"
    pad: bool = True  # fp8: may a backend zero-pad k and n to 16 in fresh buffers (a copy of A and B)?

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def d_dtype(self) -> str:
        return self.out_dtype or self.dtype

    @property
    def side_dtype(self) -> str:
        """dtype of C, bias, GELU aux and bgrad: D's, or bf16 when D is fp8."""
        return "bf16" if self.d_dtype in FP8_DTYPES else self.d_dtype


@dataclass
class GemmArgs:
    a: torch.Tensor
    b: torch.Tensor
    d: torch.Tensor  # [m, n], written
    c: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    aux: torch.Tensor | None = None  # written by *_AUX, read by DRELU/DGELU
    bgrad: torch.Tensor | None = None  # written by the *BGRAD epilogues
    alpha: float = 1.0
    beta: float = 0.0
    scales: ScaleSet = field(default_factory=ScaleSet)


class GemmPlan(Plan):
    op = "gemm"
    registry = BackendRegistry(op)

    @classmethod
    def check_descriptor(cls, desc: GemmDescriptor) -> None:
        check_dims(desc, ("m", "n", "k"))
        Epilogue.parse(desc.epilogue)  # raises, naming the allowed epilogues
        a = dtype_info(desc.dtype, "A", FLOAT_DTYPES + FP8_DTYPES).name
        b = dtype_info(desc.b_dtype or a, "B", FLOAT_DTYPES + FP8_DTYPES).name
        if desc.is_fp8:
            if b not in FP8_DTYPES:
                raise InvalidProblem(f"A is {a} but B is {b}; fp8 GEMM needs both in fp8: quantize B too")
            dtype_info(desc.d_dtype, "out_dtype", FP8_OUT_DTYPES)
            if not desc.pad:
                for dim in ("k", "n"):
                    size = getattr(desc, dim)
                    if size % FP8_ALIGN:
                        raise MisalignedOperand(
                            f"{dim} is {size}; fp8 GEMMs (cuBLASLt, torch._scaled_mm) need k and n to be "
                            f"multiples of {FP8_ALIGN}, and padding was turned off (pad=False): zero-pad "
                            f"{dim} to {-(-size // FP8_ALIGN) * FP8_ALIGN} yourself, or pass pad=True to pad "
                            f"inside (a copy of the operands)"
                        )
        else:
            if b != a or desc.d_dtype != a:
                raise InvalidProblem(
                    f"A is {a}, B is {b} and D is {desc.d_dtype}; outside fp8 all three must share "
                    f"one dtype: convert them with .to()"
                )
            if desc.scale_a != "none" or desc.scale_b != "none" or desc.scale_out:
                raise InvalidProblem(
                    f"scales were given for a {a} GEMM; scales apply to fp8 inputs only: use alpha instead"
                )
        if desc.scale_out and desc.d_dtype not in FP8_DTYPES:
            raise InvalidProblem(
                f"scales.out was given but D is {desc.d_dtype}; an output scale quantises an fp8 D: "
                f"drop it or ask for out_dtype=torch.float8_e4m3fn"
            )

    def check_args(self, args: GemmArgs) -> None:
        d = self.desc
        spec = Epilogue.parse(d.epilogue).spec
        dev = d.device
        dt = lambda name: dtype_info(name).dtype  # noqa: E731
        a_shape = (d.k, d.m) if d.transa else (d.m, d.k)
        b_shape = (d.n, d.k) if d.transb else (d.k, d.n)
        check_tensor(args.a, "A", shape=a_shape, dtype=dt(d.dtype), device=dev)
        check_tensor(args.b, "B", shape=b_shape, dtype=dt(d.b_dtype or d.dtype), device=dev)
        check_tensor(args.d, "D", shape=(d.m, d.n), dtype=dt(d.d_dtype), device=dev, output=True)
        side = dt(d.side_dtype)
        _presence(args.c, d.has_c, "C", "has_c")
        if args.c is not None:
            check_tensor(args.c, "C", shape=(d.m, d.n), dtype=side, device=dev)
        _presence(args.bias, spec.bias, "bias", f"epilogue {d.epilogue}")
        if args.bias is not None:
            check_tensor(args.bias, "bias", shape=(d.n,), dtype=side, device=dev)
        aux_act = spec.aux_activation
        _presence(args.aux, aux_act is not None, "aux", f"epilogue {d.epilogue}")
        if args.aux is not None:
            aux_dtype = torch.bool if aux_act == "relu" else side
            check_tensor(args.aux, "aux", shape=(d.m, d.n), dtype=aux_dtype, device=dev)
        _presence(args.bgrad, spec.bgrad is not None, "bgrad", f"epilogue {d.epilogue}")
        if args.bgrad is not None:
            length = d.n if spec.bgrad == "d" else d.m
            check_tensor(args.bgrad, "bgrad", shape=(length,), dtype=side, device=dev, output=True)
        for which, length, mode in (("a", d.m, d.scale_a), ("b", d.n, d.scale_b), ("out", 1, "tensor" if d.scale_out else "none")):
            if args.scales.mode(which, length) != mode:
                raise InvalidProblem(
                    f"scales.{which} is a {args.scales.mode(which, length)} scale but the plan was "
                    f"selected for a {mode} one; select a plan whose descriptor matches the call"
                )
            scale = getattr(args.scales, which)
            if isinstance(scale, torch.Tensor):  # read by the kernel: on the operands' device
                check_tensor(scale, f"scales.{which}", device=dev)
        _presence(args.scales.amax, d.amax, "scales.amax", "amax")
        if args.scales.amax is not None:
            check_tensor(args.scales.amax, "scales.amax", dtype=torch.float32, device=dev)
            if args.scales.amax.numel() != 1:
                raise InvalidProblem(
                    f"scales.amax has shape {tuple(args.scales.amax.shape)}; it must hold exactly one "
                    f"float32 element: torch.zeros((), dtype=torch.float32)"
                )
        written = {"D": args.d, "aux": args.aux if spec.aux_out else None, "bgrad": args.bgrad}
        read = {"A": args.a, "B": args.b, "C": args.c, "bias": args.bias}
        if spec.aux_in:
            read["aux"] = args.aux
        for name, out in written.items():
            if out is not None:
                check_no_overlap(out, name, read)


def _presence(t, wanted: bool, operand: str, because: str) -> None:
    if wanted and t is None:
        raise InvalidProblem(f"{operand} is None, but {because} needs it: pass {operand}")
    if not wanted and t is not None:
        raise InvalidProblem(f"{operand} was given, but {because} does not use it: drop it or pick another epilogue")


def _scale(s, like: torch.Tensor) -> torch.Tensor:
    s = s if isinstance(s, torch.Tensor) else torch.tensor(float(s))
    return s.to(device=like.device, dtype=like.dtype)


class ReferenceGemmBackend(Backend):
    """Exact semantics in fp32 (fp64 for fp64) with torch ops; runs on any device."""

    name = "reference"
    priority = 0

    def supports(self, desc: GemmDescriptor) -> str | None:
        return None  # every dtype and epilogue of the contract

    def precision(self, desc: GemmDescriptor) -> PrecisionGuarantee:
        compute = dtype_info(dtype_info(desc.dtype).compute).name
        spec = Epilogue.parse(desc.epilogue).spec
        note = "GELU is the tanh approximation" if "gelu_tanh" in (spec.activation, spec.aux_in) else ""
        return PrecisionGuarantee(compute, compute, deterministic=True, bit_stable=False, note=note)

    def run(self, desc: GemmDescriptor, args: GemmArgs, workspace) -> None:
        spec = Epilogue.parse(desc.epilogue).spec
        cd = dtype_info(desc.dtype).compute
        a = (args.a.T if desc.transa else args.a).to(cd)
        b = (args.b.T if desc.transb else args.b).to(cd)
        if args.scales.a is not None:
            sa = _scale(args.scales.a, a)
            a = a * (sa.reshape(-1, 1) if sa.numel() > 1 else sa.reshape(()))
        if args.scales.b is not None:
            sb = _scale(args.scales.b, b)
            b = b * (sb.reshape(1, -1) if sb.numel() > 1 else sb.reshape(()))
        z = (a @ b) * args.alpha
        if args.c is not None:
            z = z + args.beta * args.c.to(cd)
        if spec.bias:
            z = z + args.bias.to(cd)
        if spec.aux_out:
            args.aux.copy_(z > 0 if spec.activation == "relu" else z)
        if spec.aux_in:
            z = z * ACTIVATIONS[spec.aux_in].grad(args.aux.to(cd))
        out = ACTIVATIONS[spec.activation].fn(z)
        if spec.bgrad == "d":
            args.bgrad.copy_(out.sum(0))
        elif spec.bgrad == "a":
            args.bgrad.copy_(a.sum(1))
        if args.scales.amax is not None:
            args.scales.amax.copy_(out.abs().amax() if out.numel() else torch.zeros((), dtype=cd))
        if args.scales.out is not None:
            out = out * _scale(args.scales.out, out).reshape(())
        fp8_max = dtype_info(desc.d_dtype).fp8_max
        if fp8_max is not None:
            out = out.clamp(-fp8_max, fp8_max)  # saturate: fp8 e4m3 has no inf to overflow to
        args.d.copy_(out)


GemmPlan.registry.register(ReferenceGemmBackend())
