"""Gated activations (GLU, ReGLU, SwiGLU, GeGLU), forward and backward.

``x`` is split along ``split_dim`` into halves ``(a, b)``:

* ``gate="second"`` (the seed, ``F.glu``):   ``y = a * act(b)``
* ``gate="first"``  (Llama/Megatron ``[gate | up]``): ``y = act(a) * b``

with ``act`` = sigmoid (glu), relu (reglu), silu (swiglu), gelu (geglu; erf,
or tanh with ``approximate="tanh"``).  Writing ``g`` for the gate half and
``v`` for the other, backward is ``dv = dy * act(g)``, ``dg = dy * v * act'(g)``
(the seed's table, with the halves named by role).  It recomputes ``act``
from ``x``, so ``x`` is all that is saved.  Math runs in fp32 (fp64 for fp64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._checks import check_no_internal_overlap, check_no_overlap, check_tensor, choice, plain_eager
from .activations import ACTIVATIONS
from .dtypes import FLOAT_DTYPES, dtype_info
from .errors import InvalidProblem, Unsupported
from .kernels import triton_reason
from .plan import Backend, BackendRegistry, Plan, PrecisionGuarantee, memoised_select

KINDS = ("glu", "reglu", "swiglu", "geglu")
GATES = ("second", "first")
APPROXIMATIONS = ("none", "tanh")
MAX_RANK = 8  # the GPU kernels pass shape and strides in a fixed 8-slot parameter block
_ACT = {"glu": "sigmoid", "reglu": "relu", "swiglu": "silu", "geglu": "gelu"}


def gate_activation(kind: str, approximate: str = "none") -> str:
    """The activation (``activations.ACTIVATIONS``) that ``kind`` applies to its gate half, after checking both."""
    choice(kind, "kind", KINDS)
    choice(approximate, "approximate", APPROXIMATIONS)
    if approximate != "none" and kind != "geglu":
        raise InvalidProblem(f"approximate is {approximate!r} with kind {kind!r}; only geglu has a tanh approximation")
    act = _ACT[kind]
    return "gelu_tanh" if act == "gelu" and approximate == "tanh" else act


@dataclass(frozen=True)
class GatedActivationDescriptor:
    kind: str  # glu | reglu | swiglu | geglu
    input_shape: tuple[int, ...]  # the full, pre-split shape of x (and dx)
    split_dim: int  # 0 <= split_dim < rank; input_shape[split_dim] is even
    dtype: str
    gate: str = "second"
    approximate: str = "none"  # "tanh" only for geglu
    device: str = "cpu"

    def output_shape(self) -> tuple[int, ...]:
        out = list(self.input_shape)
        out[self.split_dim] //= 2
        return tuple(out)

    @property
    def activation(self) -> str:
        act = _ACT[self.kind]
        return "gelu_tanh" if act == "gelu" and self.approximate == "tanh" else act


@dataclass
class GatedActivationArgs:
    x: torch.Tensor  # input_shape
    y: torch.Tensor  # output_shape, written


@dataclass
class GatedActivationBackwardArgs:
    dy: torch.Tensor  # output_shape
    x: torch.Tensor  # input_shape, the saved forward input
    dx: torch.Tensor  # input_shape, written


def _check_descriptor(desc: GatedActivationDescriptor) -> None:
    """The seed's validation order: rank, split_dim, dims, parity, rank cap, scope."""
    dtype_info(desc.dtype, "descriptor.dtype")
    rank = len(desc.input_shape)
    if rank == 0:
        raise InvalidProblem("x is 0-d; a gated activation needs an axis to split: pass x with rank >= 1")
    if not 0 <= desc.split_dim < rank:
        raise InvalidProblem(
            f"split_dim is {desc.split_dim} but x has rank {rank}; it must lie in [{-rank}, {rank - 1}]"
        )
    if any(d < 0 for d in desc.input_shape):
        raise InvalidProblem(f"input_shape {desc.input_shape} has a negative dimension; dims must be >= 0")
    size = desc.input_shape[desc.split_dim]
    if size % 2:
        raise InvalidProblem(
            f"x has size {size} along split_dim {desc.split_dim}, which is odd; it must be even to "
            f"split into two halves: check the projection width (2 * hidden)"
        )
    if rank > MAX_RANK:
        raise Unsupported(
            f"x has rank {rank}; gated activations support rank <= {MAX_RANK}: merge adjacent "
            f"dimensions that are not split_dim with reshape"
        )
    choice(desc.kind, "kind", KINDS)
    choice(desc.gate, "gate", GATES)
    choice(desc.approximate, "approximate", APPROXIMATIONS)
    if desc.approximate != "none" and desc.kind != "geglu":
        raise InvalidProblem(
            f"approximate is {desc.approximate!r} with kind {desc.kind!r}; only geglu has a tanh "
            f"approximation: use approximate='none'"
        )


def _halves(t: torch.Tensor, desc: GatedActivationDescriptor):
    """(gate half, value half) as views: no copies, any strides."""
    half = desc.input_shape[desc.split_dim] // 2
    a = t.narrow(desc.split_dim, 0, half)
    b = t.narrow(desc.split_dim, half, half)
    return (a, b) if desc.gate == "first" else (b, a)


class _GatedPlan(Plan):
    """Forward and backward share one descriptor and its validation."""

    @classmethod
    def check_descriptor(cls, desc: GatedActivationDescriptor) -> None:
        _check_descriptor(desc)


class GatedActivationPlan(_GatedPlan):
    op = "gated_activation"
    registry = BackendRegistry(op)

    def check_args(self, args: GatedActivationArgs) -> None:
        d = self.desc
        dtype = dtype_info(d.dtype).dtype
        check_tensor(args.x, "x", shape=d.input_shape, dtype=dtype, device=d.device)
        check_tensor(args.y, "y", shape=d.output_shape(), dtype=dtype, device=d.device, output=True)
        check_no_internal_overlap(args.y, "y")
        check_no_overlap(args.y, "y", {"x": args.x})


class GatedActivationBackwardPlan(_GatedPlan):
    op = "gated_activation_backward"
    registry = BackendRegistry(op)

    def check_args(self, args: GatedActivationBackwardArgs) -> None:
        d = self.desc
        dtype = dtype_info(d.dtype).dtype
        check_tensor(args.dy, "dy", shape=d.output_shape(), dtype=dtype, device=d.device)
        check_tensor(args.x, "x", shape=d.input_shape, dtype=dtype, device=d.device)
        check_tensor(args.dx, "dx", shape=d.input_shape, dtype=dtype, device=d.device, output=True)
        check_no_internal_overlap(args.dx, "dx")
        check_no_overlap(args.dx, "dx", {"x": args.x, "dy": args.dy})


class _ReferenceGated(Backend):
    name = "reference"
    priority = 0

    def supports(self, desc) -> str | None:
        if desc.dtype not in FLOAT_DTYPES:
            return f"dtype {desc.dtype} is not one of {FLOAT_DTYPES}"
        return None

    def precision(self, desc) -> PrecisionGuarantee:
        name = dtype_info(dtype_info(desc.dtype).compute).name
        return PrecisionGuarantee(name, name, deterministic=True, bit_stable=True)


class ReferenceGatedForward(_ReferenceGated):
    def run(self, desc, args: GatedActivationArgs, workspace) -> None:
        compute = dtype_info(desc.dtype).compute
        g, v = _halves(args.x, desc)
        args.y.copy_(v.to(compute) * ACTIVATIONS[desc.activation].fn(g.to(compute)))


class ReferenceGatedBackward(_ReferenceGated):
    def run(self, desc, args: GatedActivationBackwardArgs, workspace) -> None:
        compute = dtype_info(desc.dtype).compute
        act = ACTIVATIONS[desc.activation]
        g, v = (h.to(compute) for h in _halves(args.x, desc))
        dy = args.dy.to(compute)
        dg, dv = _halves(args.dx, desc)
        dv.copy_(dy * act.fn(g))
        dg.copy_(dy * v * act.grad(g))


class _TritonGated(Backend):
    """``kernels/gated.py``: one pass over x (and dy), any rank and strides, no copies."""

    name = "triton"
    priority = 10

    def supports(self, desc) -> str | None:
        if desc.dtype not in FLOAT_DTYPES:
            return f"dtype {desc.dtype} is not one of {FLOAT_DTYPES}"
        return triton_reason(desc.device)

    def priority_for(self, desc) -> int:
        # On CPU the kernel runs only under the Triton interpreter: a test tool, never the default.
        return self.priority if desc.device.startswith("cuda") else -1

    def precision(self, desc) -> PrecisionGuarantee:
        name = dtype_info(dtype_info(desc.dtype).compute).name
        return PrecisionGuarantee(
            name, name, deterministic=True, bit_stable=True,
            note=(
                "elementwise, fp32 math (fp64 for f64). sigmoid and tanh go through exp; GeGLU's Phi is an "
                "erfc of fractional error < 1.2e-7 for f32, < 6.4e-5 for f16/bf16 (1/8 of f16's rounding), and "
                "libdevice erf for f64. Results can differ from torch's in the last ulps; unlike 1 + erf, they "
                "keep relative accuracy in the tails"
            ),
        )


class TritonGatedForward(_TritonGated):
    def run(self, desc, args: GatedActivationArgs, workspace) -> None:
        from .kernels.gated import launch

        launch(args.x, None, args.y, desc)


class TritonGatedBackward(_TritonGated):
    def run(self, desc, args: GatedActivationBackwardArgs, workspace) -> None:
        from .kernels.gated import launch

        launch(args.x, args.dy, args.dx, desc)


GatedActivationPlan.registry.register(ReferenceGatedForward())
GatedActivationPlan.registry.register(TritonGatedForward())
GatedActivationBackwardPlan.registry.register(ReferenceGatedBackward())
GatedActivationBackwardPlan.registry.register(TritonGatedBackward())


# -- custom ops --------------------------------------------------------------
# Four ops: forward and backward, each returning a new tensor or writing ``out``.
# The ``out`` forms mutate their last argument, so torch.compile functionalises them.


def _descriptor(x: torch.Tensor, kind: str, dim: int, gate: str, approximate: str) -> GatedActivationDescriptor:
    return _descriptor_of(x.shape, x.dtype, x.device, kind, dim, gate, approximate)


# Descriptors are rebuilt from hashable call parameters on every call: memoised, they cost a dict hit.
@functools.lru_cache(maxsize=4096)
def _descriptor_of(shape, dtype, device, kind, dim, gate, approximate) -> GatedActivationDescriptor:
    return GatedActivationDescriptor(
        kind=kind,
        input_shape=tuple(shape),
        split_dim=dim,
        dtype=dtype_info(dtype).name,
        gate=gate,
        approximate=approximate,
        device=str(device),
    )


def _forward(x, kind, dim, gate, approximate, y) -> None:
    desc = _descriptor(x, kind, dim, gate, approximate)
    memoised_select(GatedActivationPlan, desc).run(GatedActivationArgs(x, y))


def _backward_into(dy, x, kind, dim, gate, approximate, dx) -> None:
    desc = _descriptor(x, kind, dim, gate, approximate)
    memoised_select(GatedActivationBackwardPlan, desc).run(GatedActivationBackwardArgs(dy, x, dx))


def _halved(x: torch.Tensor, dim: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] //= 2
    return shape


def _gated_impl(x: torch.Tensor, kind: str, dim: int, gate: str, approximate: str) -> torch.Tensor:
    y = x.new_empty(_halved(x, dim))
    _forward(x, kind, dim, gate, approximate, y)
    return y


_gated_op = torch.library.custom_op("kernelplan::gated_activation", mutates_args=())(_gated_impl)


@_gated_op.register_fake
def _(x, kind, dim, gate, approximate):
    return x.new_empty(_halved(x, dim))


@torch.library.custom_op("kernelplan::gated_activation_out", mutates_args=("out",))
def _gated_out_op(x: torch.Tensor, kind: str, dim: int, gate: str, approximate: str, out: torch.Tensor) -> None:
    _forward(x, kind, dim, gate, approximate, out)


@_gated_out_op.register_fake
def _(x, kind, dim, gate, approximate, out):
    return None


@torch.library.custom_op("kernelplan::gated_activation_backward", mutates_args=())
def _gated_backward_op(
    dy: torch.Tensor, x: torch.Tensor, kind: str, dim: int, gate: str, approximate: str
) -> torch.Tensor:
    dx = torch.empty_like(x)
    _backward_into(dy, x, kind, dim, gate, approximate, dx)
    return dx


@_gated_backward_op.register_fake
def _(dy, x, kind, dim, gate, approximate):
    return torch.empty_like(x)


@torch.library.custom_op("kernelplan::gated_activation_backward_out", mutates_args=("out",))
def _gated_backward_out_op(
    dy: torch.Tensor, x: torch.Tensor, kind: str, dim: int, gate: str, approximate: str, out: torch.Tensor
) -> None:
    _backward_into(dy, x, kind, dim, gate, approximate, out)


@_gated_backward_out_op.register_fake
def _(dy, x, kind, dim, gate, approximate, out):
    return None


def _setup(ctx, inputs, output):
    x, ctx.kind, ctx.dim, ctx.gate, ctx.approximate = inputs
    ctx.save_for_backward(x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    dx = _gated_backward_op(dy, x, ctx.kind, ctx.dim, ctx.gate, ctx.approximate)
    return dx, None, None, None, None


_gated_op.register_autograd(_backward, setup_context=_setup)


def _normalise(x, kind, dim, gate, approximate) -> GatedActivationDescriptor:
    """The validated descriptor of a call; raises naming the bad argument."""
    check_tensor(x, "x")
    key = (x.shape, x.dtype, x.device, kind, dim, gate, approximate)
    if all(isinstance(v, str) for v in (kind, gate, approximate)) and type(dim) is int:
        return _validated(*key)  # hashable: a repeat call is a dict hit
    return _validated.__wrapped__(*key)


@functools.lru_cache(maxsize=4096)
def _validated(shape, dtype, device, kind, dim, gate, approximate) -> GatedActivationDescriptor:
    dtype_info(dtype, "x", FLOAT_DTYPES)
    rank = len(shape)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -max(rank, 1) <= dim < max(rank, 1):
        raise InvalidProblem(f"dim is {dim!r} but x has rank {rank}; it must be an int in [{-rank}, {rank - 1}]")
    desc = _descriptor_of(shape, dtype, device, choice(kind, "kind", KINDS), dim % max(rank, 1),
                          choice(gate, "gate", GATES), choice(approximate, "approximate", APPROXIMATIONS))
    _check_descriptor(desc)
    return desc


def _check_out_without_grad(out, *inputs: tuple[str, torch.Tensor]) -> None:
    if out is not None:
        # On the inputs' device: a meta x with a real out would otherwise return with out never written.
        check_tensor(out, "out", device=inputs[0][1].device)
    if out is None or not torch.is_grad_enabled():
        return
    for name, t in inputs:
        if t.requires_grad:
            raise InvalidProblem(
                f"out= was given but {name} requires grad; like torch's out= functions, the out= "
                f"form is not differentiable: drop out=, or call it under torch.no_grad()"
            )


def gated_activation(
    x: torch.Tensor,
    kind: str,
    dim: int = -1,
    gate: str = "second",
    approximate: str = "none",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split ``x`` along ``dim`` and gate one half with the other; differentiable in ``x``.

    ``out``, if given, receives the result (any strides; it must not overlap ``x``)
    and is returned.  That form is for inference and is not differentiable.
    """
    d = _normalise(x, kind, dim, gate, approximate)
    if out is None:
        op = _gated_impl if plain_eager(x) else _gated_op
        return op(x, d.kind, d.split_dim, d.gate, d.approximate)
    _check_out_without_grad(out, ("x", x))
    _gated_out_op(x, d.kind, d.split_dim, d.gate, d.approximate, out)
    return out


def gated_activation_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    dim: int = -1,
    gate: str = "second",
    approximate: str = "none",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dx`` of :func:`gated_activation` from the upstream ``dy`` and the forward input ``x``.

    Nothing is written into ``x`` or ``dy``; ``out``, if given, receives ``dx`` and is returned.
    """
    d = _normalise(x, kind, dim, gate, approximate)
    check_tensor(dy, "dy", shape=d.output_shape(), dtype=x.dtype, device=x.device)
    if out is None:
        return _gated_backward_op(dy, x, d.kind, d.split_dim, d.gate, d.approximate)
    _check_out_without_grad(out, ("x", x), ("dy", dy))
    _gated_backward_out_op(dy, x, d.kind, d.split_dim, d.gate, d.approximate, out)
    return out
