"""Validation helpers shared by the ops: each raises with operand, value, requirement, fix."""

from __future__ import annotations

import logging
import warnings
from typing import Sequence

import torch

from .errors import BufferTooSmall, InvalidProblem


def class_name(obj) -> str:
    """``obj``'s class, qualified by its module: how tables of known classes (sparsify's, the experts') key them, so
    that a class of the same name elsewhere is not taken for one of them."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def same_device(actual: torch.device, wanted: str | torch.device) -> bool:
    """``actual`` is ``wanted``, where a bare ``"cuda"`` means the current CUDA device (as in torch)."""
    want = torch.device(wanted)
    if want.type == "cuda" and want.index is None and actual.type == "cuda":
        return actual.index == torch.cuda.current_device()
    return actual == want


def check_tensor(
    t,
    operand: str,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    output: bool = False,
) -> None:
    """Check type, dtype, device and shape; an ``output`` with too few elements is BufferTooSmall."""
    if not isinstance(t, torch.Tensor):
        raise InvalidProblem(f"{operand} is a {type(t).__name__}; it must be a torch.Tensor")
    if dtype is not None and t.dtype != dtype:
        raise InvalidProblem(
            f"{operand} has dtype {t.dtype} but must have dtype {dtype}: convert it with .to({dtype})"
        )
    if device is not None and not same_device(t.device, device):
        raise InvalidProblem(
            f"{operand} is on {t.device} but the op runs on {device}: move it with .to({str(device)!r})"
        )
    if shape is not None and tuple(t.shape) != tuple(shape):
        if output and t.numel() < _numel(shape):
            raise BufferTooSmall(_numel(shape), t.numel(), operand=f"{operand} (shape {tuple(t.shape)})")
        raise InvalidProblem(
            f"{operand} has shape {tuple(t.shape)} but must have shape {tuple(shape)}; "
            f"allocate it with that shape or reshape it"
        )


_WARNED: set = set()


def warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """``warnings.warn``, never an exception: where warnings are turned into errors (``-W error``, pytest's
    ``filterwarnings = error``), the message goes to the ``kernelplan`` logger instead, and the computation that
    warned goes on (a warning must not be the reason a computation fails; ``cache.warn`` does the same)."""
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Exception:  # noqa: BLE001  the filter raised it
        logging.getLogger("kernelplan").warning("%s", message)


def warn_once(message: str, stacklevel: int = 3) -> None:
    """A ``RuntimeWarning`` with ``message`` (``warn``: never an exception), the first time this process meets it."""
    if message not in _WARNED:
        _WARNED.add(message)
        warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def check_has_data(t: torch.Tensor, operand: str, what: str) -> None:
    """Refuse a meta tensor where values are read: it has a shape and a dtype but no data."""
    if t.is_meta:
        raise InvalidProblem(
            f"{operand} is a meta tensor (shape {tuple(t.shape)}, no data), and {what} reads its values: "
            f"materialise it first (torch.empty_like(t, device='cpu') or load the weights)"
        )


def check_scalar(value, operand: str) -> float:
    """A real scalar argument (a Python number or a one-element tensor) as a float, or a clear error."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.is_meta:
            raise InvalidProblem(
                f"{operand} is a tensor of shape {tuple(value.shape)}; it must be a real scalar: "
                f"pass a Python float (or a one-element tensor)"
            )
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidProblem(f"{operand} is {value!r} ({type(value).__name__}); it must be a real number such as 1.0")
    return float(value)


def check_no_overlap(out: torch.Tensor, out_name: str, inputs: dict[str, torch.Tensor | None]) -> None:
    """Refuse an output that shares memory with an input: the kernels read after writing."""
    for name, t in inputs.items():
        if t is not None and t.numel() > 0 and out.numel() > 0 and _overlaps(out, t):
            raise InvalidProblem(
                f"{out_name} shares memory with {name}; the op would overwrite its own input. "
                f"Pass a separate {out_name} tensor (or leave it None)"
            )


def check_no_internal_overlap(out: torch.Tensor, operand: str) -> None:
    """Refuse an output whose elements share memory (an expanded view, say): writes would race."""
    dims = sorted((st, n) for st, n in zip(out.stride(), out.shape) if n > 1)
    reach = 0  # the furthest offset the smaller-stride dims reach
    for st, n in dims:
        if st <= reach:
            raise InvalidProblem(
                f"{operand} has shape {tuple(out.shape)} and strides {out.stride()}, so some of its "
                f"elements share memory; an output needs distinct elements: pass a fresh tensor "
                f"(torch.empty) or a view of one"
            )
        reach += st * (n - 1)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.data_ptr() != sb.data_ptr():
        return False
    # Same storage: compare the byte ranges each view can touch.
    def span(t):
        start = t.storage_offset() * t.element_size()
        extent = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_dims(desc, names: Sequence[str]) -> None:
    """Every named descriptor dimension is a non-negative int."""
    for name in names:
        value = getattr(desc, name)
        if value < 0:
            raise InvalidProblem(f"descriptor.{name} is {value}; it must be >= 0")


def choice(value, operand: str, allowed: Sequence[str]) -> str:
    """Normalise a string option, or raise naming the allowed ones."""
    if isinstance(value, str) and value.lower() in allowed:
        return value.lower()
    raise InvalidProblem(f"{operand} is {value!r}; it must be one of {', '.join(map(repr, allowed))}")


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True when the custom op would add nothing: no tracing, no autograd, plain tensors.

    The op's dispatcher round trip cost more host time than the rest of a call
    (measured on the CPU CI machine with a no-op 2:4 backend: 61 us per call
    through the op, 23 us without); torch.compile, autograd and tensor
    subclasses (FakeTensor, DTensor, ...) still go through it.
    """
    if _is_compiling():
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is None:
            continue
        kind = type(t)
        if kind is not _TENSOR and kind is not _PARAMETER:
            return False
        if grad and t.requires_grad:
            return False
    return True


# Bound once: each module attribute read costs host time on every eager call (plain_eager runs on each one).
# torch.compile recognizes the function itself, whatever name calls it.
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
