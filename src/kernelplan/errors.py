"""Exceptions raised by kernelplan.

Every message names the operand, the value seen, the requirement and the fix,
so that a user can act on it without reading the source.  Which class:

* bad input                          -> :class:`InvalidProblem` (a ``ValueError``)
* valid, but no backend can run it    -> :class:`Unsupported` (a ``NotImplementedError``)
* a dimension or pointer misaligned   -> :class:`MisalignedOperand`
* workspace / buffer too small        -> :class:`WorkspaceTooSmall` / :class:`BufferTooSmall`
* object used in the wrong state      -> :class:`InvalidState` (a ``RuntimeError``)
"""

from __future__ import annotations


class KernelPlanError(Exception):
    """Base class of every error kernelplan raises on purpose."""


class InvalidProblem(KernelPlanError, ValueError):
    """The problem is ill-formed: shapes, dtypes or arguments contradict each other."""


class Unsupported(KernelPlanError, NotImplementedError):
    """The problem is well-formed, but no (selected) backend implements it."""


class MisalignedOperand(InvalidProblem):
    """A dimension, stride or address does not meet an alignment requirement.

    It is an :class:`InvalidProblem` too, so ``except ValueError`` catches it.
    """


class _TooSmall(InvalidProblem):
    unit = "elements"
    fix = "allocate {operand} with at least {needed} {unit}"

    def __init__(self, needed: int, got: int, operand: str, fix: str | None = None):
        self.needed = int(needed)
        self.got = int(got)
        fix = (fix or self.fix).format(operand=operand, needed=self.needed, unit=self.unit)
        super().__init__(f"{operand} holds {self.got} {self.unit} but {self.needed} are needed; {fix}")


class WorkspaceTooSmall(_TooSmall):
    """The workspace handed to ``plan.run`` is smaller than ``plan.workspace_size()``."""

    unit = "bytes"
    fix = "pass at least plan.workspace_size() = {needed} bytes, or workspace=None to let the plan allocate it"

    def __init__(self, needed: int, got: int, operand: str = "workspace", fix: str | None = None):
        super().__init__(needed, got, operand, fix)


class BufferTooSmall(_TooSmall):
    """An output or auxiliary buffer holds fewer elements than the op writes."""

    fix = "allocate {operand} with {needed} elements (or leave it None)"

    def __init__(self, needed: int, got: int, operand: str = "buffer"):
        super().__init__(needed, got, operand)


class InvalidState(KernelPlanError, RuntimeError):
    """An object was used before it was ready, or after it was invalidated."""


__all__ = [
    "KernelPlanError",
    "InvalidProblem",
    "Unsupported",
    "MisalignedOperand",
    "WorkspaceTooSmall",
    "BufferTooSmall",
    "InvalidState",
]
