"""``kernelplan.linear``: nn.Linear-layout GEMM with a fused epilogue, autograd-aware."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .._checks import check_no_internal_overlap, check_scalar, check_tensor
from ..activations import ACTIVATIONS
from ..dtypes import FP8_DTYPES, dtype_info
from ..errors import InvalidProblem, Unsupported
from ..plan import dispatch_generation, memoised_select
from .epilogue import Epilogue, ScaleSet
from .plan import GemmArgs, GemmDescriptor, GemmPlan

# The forward epilogue whose aux backward needs, for each activation epilogue.
_WITH_AUX = {
    Epilogue.RELU: Epilogue.RELU_AUX,
    Epilogue.RELU_BIAS: Epilogue.RELU_AUX_BIAS,
    Epilogue.GELU: Epilogue.GELU_AUX,
    Epilogue.GELU_BIAS: Epilogue.GELU_AUX_BIAS,
}


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    epilogue: Epilogue | str | None = None,
    *,
    alpha: float = 1.0,
    beta: float | None = None,
    c: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scales: ScaleSet | None = None,
    out_dtype: torch.dtype | None = None,
    pad: bool = True,
):
    """``epilogue(alpha * x @ w^T + beta * c)``, ``w`` in nn.Linear layout ``[out, in]``.

    ``x`` may have any leading shape ``[..., in]``; ``c``, ``aux`` and ``out``
    are ``[..., out]``.  Returns ``D``; the *_AUX epilogues return
    ``(D, aux)`` and the *BGRAD ones ``(D, bgrad)``.  For DRELU/DGELU pass the
    ``aux`` written by the matching *_AUX forward.  Forward epilogues in
    f16/bf16/f32/f64 are differentiable in ``x``, ``w``, ``bias`` and ``c``.
    ``epilogue=None`` means BIAS when ``bias`` is given, else NONE.  With fp8
    inputs, ``pad=False`` turns a k or n off the multiple of 16 into a
    :class:`MisalignedOperand` instead of a padded copy of the operands.
    ``beta`` defaults to 1 where ``c`` is given (as ``torch.addmm``) and 0
    where it is not; ``beta = 0`` does not read ``c`` (as cuBLASLt), so NaN in
    it does not reach D.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):  # lists, arrays: before any attribute
        check_tensor(x, "x")
        check_tensor(w, "w")
    if beta is None:
        beta = 1.0 if c is not None else 0.0
    elif c is None and beta != 0:
        raise InvalidProblem(f"beta is {beta!r} but c is None; beta scales c: pass c=, or leave beta out")
    if torch.compiler.is_compiling():
        return _linear_traced(x, w, bias, epilogue, alpha, beta, c, aux, out, scales, out_dtype, pad)
    plain = (epilogue is None and c is None and aux is None and out is None and scales is None
             and out_dtype is None and alpha == 1.0 and pad)
    if plain and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or
                                                   (bias is not None and bias.requires_grad))):
        fast_key = _fast_key(x, w, bias)
        hit = _prepared.get(fast_key)
        if hit is not None and hit[0] == dispatch_generation(GemmPlan):
            _, call, x_2d, out_shape = hit
            d = call(x if x_2d is None else x.reshape(x_2d), w, bias)
            return d if out_shape is None else d.reshape(out_shape)
    else:
        fast_key = None
    if epilogue is None:
        epilogue = Epilogue.BIAS if bias is not None else Epilogue.NONE
    ep = Epilogue.parse(epilogue)
    spec = ep.spec
    scales = scales if scales is not None else ScaleSet()
    alpha, beta = check_scalar(alpha, "alpha"), check_scalar(beta, "beta")
    if beta == 0:
        c = None  # not read, as cuBLASLt does not read C at beta = 0: NaN in c stays out of D
    check_tensor(x, "x")
    check_tensor(w, "w", device=x.device)
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise InvalidProblem(
            f"x has shape {tuple(x.shape)} and w {tuple(w.shape)}; w must be [out, in] and x [..., in] "
            f"with the same in (nn.Linear layout)"
        )
    lead = tuple(x.shape[:-1])
    m, n, k = math.prod(lead), w.shape[0], w.shape[1]
    x_name = dtype_info(x.dtype, "x").name
    desc = GemmDescriptor(
        m=m,
        n=n,
        k=k,
        dtype=x_name,
        b_dtype=dtype_info(w.dtype, "w").name,
        out_dtype=dtype_info(out_dtype, "out_dtype").name if out_dtype is not None else None,
        epilogue=ep.value,
        transb=True,
        has_c=c is not None,
        scale_a=scales.mode("a", m),
        scale_b=scales.mode("b", n),
        scale_out=scales.out is not None,
        amax=scales.amax is not None,
        device=str(x.device),
        pad=pad,
    )
    plan = memoised_select(GemmPlan, desc)
    side = dtype_info(desc.side_dtype).dtype
    out_shape = (*lead, n)
    x2 = x.reshape(m, k)
    c2 = _as_2d(c, "c", out_shape, m, n)
    d = _as_2d(out, "out", out_shape, m, n)
    if d is not None:
        check_no_internal_overlap(d, "out")
    if d is None:
        d = torch.empty((m, n), dtype=dtype_info(desc.d_dtype).dtype, device=x.device)
    aux2 = _as_2d(aux, "aux", out_shape, m, n)
    if aux2 is None and spec.aux_out:
        aux2 = torch.empty((m, n), dtype=torch.bool if spec.activation == "relu" else side, device=x.device)
    bgrad = None
    if spec.bgrad is not None:
        bgrad = torch.empty((n if spec.bgrad == "d" else m,), dtype=side, device=x.device)
    args = GemmArgs(x2, w, d, c=c2, bias=bias, aux=aux2, bgrad=bgrad, alpha=alpha, beta=beta, scales=scales)

    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias, c, aux)):
        _check_differentiable(ep, desc.is_fp8, aux, out, x_name)
        plan.can_implement(args)
        d, aux_saved, _ = _differentiable(x2, w, bias, c2, ep, alpha, beta, aux2 is not None)
        if aux is not None:
            aux2.copy_(aux_saved)
        elif aux2 is not None:
            aux2 = aux_saved
    else:
        plan.run(args)
        if fast_key is not None:
            if len(_prepared) >= _MAX_PREPARED:
                _prepared.clear()
            # The reshapes are skipped where x is already [m, k]: each is a microsecond of host time.
            flat = x.dim() == 2
            _prepared[fast_key] = (dispatch_generation(GemmPlan), _bound(plan), None if flat else (m, k),
                                   None if flat else out_shape)
    d = d.reshape(out_shape) if out is None else out
    if spec.aux_out:
        return d, aux2.reshape(out_shape)
    if spec.bgrad == "a":
        return d, bgrad.reshape(lead)
    if spec.bgrad == "d":
        return d, bgrad
    return d


# The inference fast path: a plain ``linear(x, w[, bias])`` whose operands have the shapes,
# dtypes and devices of a call that passed every check reuses that call's plan and
# skips the checks (they would pass again: nothing they look at differs).  Void once dispatch
# may answer differently (a new measurement, a registry change).  Entries are
# (generation, call, x as 2-D or None, output shape or None); ``call(x2, w, bias) -> d`` is the
# plan's backend bound to its descriptor where the backend offers that (``Backend.bind``).
_prepared: dict = {}
_MAX_PREPARED = 4096


def _bound(plan: GemmPlan):
    """``call(x2, w, bias) -> d [m, n]`` for a plain linear through ``plan``."""
    out_dtype = dtype_info(plan.desc.d_dtype).dtype
    return plan.backend.bind(plan.desc) or functools.partial(_run_plain, plan, out_dtype)


def _run_plain(plan: GemmPlan, out_dtype: torch.dtype, x2, w, bias) -> torch.Tensor:
    d = torch.empty((plan.desc.m, plan.desc.n), dtype=out_dtype, device=x2.device)
    # linear() checked every operand against this descriptor on the call that made the entry.
    plan.run_prechecked(GemmArgs(x2, w, d, bias=bias))
    return d


def _fast_key(x, w, bias):
    # What the checks and the descriptor look at: no strides.  Every backend's run takes any
    # layout (copying where its library needs one) and the bound cuBLASLt call keys its routes
    # on strides itself, so a new layout of a known problem stays on the fast path.
    b = None if bias is None else (bias.shape, bias.dtype, bias.device)
    return x.shape, x.dtype, x.device, w.shape, w.dtype, w.device, b


def _as_2d(t, operand, shape, m, n):
    if t is None:
        return None
    check_tensor(t, operand)
    if tuple(t.shape) != shape:
        raise InvalidProblem(f"{operand} has shape {tuple(t.shape)} but must be {shape}, the shape of the output")
    try:
        return t.view(m, n)
    except RuntimeError:
        raise InvalidProblem(
            f"{operand} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[{m}, {n}] without a copy; pass a contiguous {operand}"
        ) from None


def _check_differentiable(ep: Epilogue, is_fp8: bool, aux, out, x_name: str) -> None:
    spec = ep.spec
    if is_fp8 or spec.aux_in or spec.bgrad or (aux is not None and aux.requires_grad):
        raise Unsupported(
            f"kernelplan.linear with epilogue {ep.name} and dtype {x_name} is not differentiable "
            f"(backward building blocks, fp8 and gradients into aux have no autograd formula); "
            f"call it under torch.no_grad() or detach the inputs"
        )
    if out is not None:
        raise InvalidProblem(
            "out= was given while inputs require grad; out= does not support autograd: "
            "drop out= or call under torch.no_grad()"
        )


def _differentiable(x2, w, bias, c2, ep: Epilogue, alpha: float, beta: float, aux_wanted: bool):
    """``(d, aux, empty)`` through the custom op, with the *_AUX epilogue that backward needs."""
    d, aux = _linear_op(x2, w, bias, c2, _WITH_AUX.get(ep, ep).value, alpha, beta)
    return d, aux.detach(), None  # aux is what backward reads, not a differentiable output


# -- custom ops: one pattern for eager autograd and torch.compile ------------------------------
#
# linear()'s eager path is plain Python around a plan (dict caches, logging), which dynamo cannot
# trace; under torch.compile linear() calls these ops instead, and in eager autograd the first
# carries the formula.  Both run the eager, no-grad linear() inside.
# * ``kernelplan::linear``: the differentiable forward epilogues, outputs (D, aux), aux empty
#   where the epilogue has none;
# * ``kernelplan::linear_ext``: everything (fp8 scales, aux in, bgrad), no autograd; outputs
#   (D, aux, bgrad), empty where absent; ``amax`` is written in place.

def _run_eager(x, w, bias, c, aux, scales, epilogue, alpha, beta, out_dtype, pad):
    ep = Epilogue.parse(epilogue)
    with torch.no_grad():  # the op's own autograd formula stands for this call's
        result = linear(x, w, bias, ep, alpha=alpha, beta=beta, c=c, aux=aux, scales=scales, out_dtype=out_dtype,
                        pad=pad)
    d, side = (result, None) if isinstance(result, torch.Tensor) else result
    if ep.spec.aux_out:
        return d, side, d.new_empty(0)
    return d, d.new_empty(0), (side if side is not None else d.new_empty(0))  # distinct: outputs may not alias


def _fake_outputs(x, w, epilogue, out_dtype):
    spec = Epilogue.parse(epilogue).spec
    n, lead = w.shape[0], tuple(x.shape[:-1])
    d_name = dtype_info(out_dtype).name if out_dtype is not None else dtype_info(x.dtype).name
    side = dtype_info("bf16" if d_name in FP8_DTYPES else d_name).dtype
    d = x.new_empty((*lead, n), dtype=dtype_info(d_name).dtype)
    aux_out = d.new_empty(0)
    if spec.aux_out:
        aux_out = x.new_empty((*lead, n), dtype=torch.bool if spec.activation == "relu" else side)
    bgrad = d.new_empty(0)
    if spec.bgrad is not None:
        bgrad = x.new_empty((n,) if spec.bgrad == "d" else lead, dtype=side)
    return d, aux_out, bgrad


@torch.library.custom_op("kernelplan::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], c: Optional[torch.Tensor],
               epilogue: str, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_eager(x, w, bias, c, None, None, epilogue, alpha, beta, None, True)[:2]


@_linear_op.register_fake
def _(x, w, bias, c, epilogue, alpha, beta):
    return _fake_outputs(x, w, epilogue, None)[:2]


@torch.library.custom_op("kernelplan::linear_ext", mutates_args=("amax",))
def _linear_ext_op(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], c: Optional[torch.Tensor],
    aux: Optional[torch.Tensor], scale_a: Optional[torch.Tensor], scale_b: Optional[torch.Tensor],
    scale_out: Optional[torch.Tensor], amax: Optional[torch.Tensor], epilogue: str, alpha: float, beta: float,
    out_dtype: Optional[torch.dtype], pad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = None
    if any(s is not None for s in (scale_a, scale_b, scale_out, amax)):
        scales = ScaleSet(scale_a, scale_b, scale_out, amax)
    return _run_eager(x, w, bias, c, aux, scales, epilogue, alpha, beta, out_dtype, pad)


@_linear_ext_op.register_fake
def _(x, w, bias, c, aux, scale_a, scale_b, scale_out, amax, epilogue, alpha, beta, out_dtype, pad):
    return _fake_outputs(x, w, epilogue, out_dtype)


def _setup(ctx, inputs, output):
    x, w, bias, c, epilogue, alpha, beta = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.act = Epilogue.parse(epilogue).spec.activation
    ctx.alpha, ctx.beta, ctx.has_bias, ctx.has_c = alpha, beta, bias is not None, c is not None


def _backward(ctx, dd, _daux):
    x, w, aux = ctx.saved_tensors
    cd = dtype_info(x.dtype).compute
    x2 = x.reshape(-1, x.shape[-1])
    dz = dd.reshape(-1, w.shape[0]).to(cd)
    if ctx.act != "identity":
        dz = dz * ACTIVATIONS[ctx.act].grad(aux.reshape(dz.shape).to(cd))
    need = ctx.needs_input_grad
    dx = (ctx.alpha * dz @ w.to(cd)).to(x.dtype).reshape(x.shape) if need[0] else None
    dw = (ctx.alpha * dz.T @ x2.to(cd)).to(w.dtype) if need[1] else None
    dbias = dz.sum(0).to(x.dtype) if ctx.has_bias and need[2] else None
    dc = (ctx.beta * dz).to(x.dtype).reshape(dd.shape) if ctx.has_c and need[3] else None
    return dx, dw, dbias, dc, None, None, None


_linear_op.register_autograd(_backward, setup_context=_setup)


def _scale_tensor(s, x):
    return s if s is None or isinstance(s, torch.Tensor) else torch.tensor(float(s), device=x.device)


def _linear_traced(x, w, bias, epilogue, alpha, beta, c, aux, out, scales, out_dtype, pad):
    """linear() as torch.compile traces it: the same results, through the custom op."""
    if epilogue is None:
        epilogue = Epilogue.BIAS if bias is not None else Epilogue.NONE
    ep = Epilogue.parse(epilogue)
    spec = ep.spec
    scales = scales if scales is not None else ScaleSet()
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias, c, aux))
    if grad:
        _check_differentiable(ep, x.dtype in _FP8_TORCH, aux, out, str(x.dtype))
        d, aux_out, bgrad = _differentiable(x, w, bias, c, ep, alpha, beta, spec.aux_out)
    else:
        d, aux_out, bgrad = _linear_ext_op(
            x, w, bias, c, aux if spec.aux_in else None, _scale_tensor(scales.a, x), _scale_tensor(scales.b, x),
            _scale_tensor(scales.out, x), scales.amax, ep.value, alpha, beta, out_dtype, pad)
    if out is not None:
        out.copy_(d)
        d = out
    if spec.aux_out:
        if aux is not None:
            aux.copy_(aux_out)
            aux_out = aux
        return d, aux_out
    if spec.bgrad is not None:
        return d, bgrad
    return d


_FP8_TORCH = tuple(dtype_info(name).dtype for name in FP8_DTYPES)
