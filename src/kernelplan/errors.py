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


class WorkspaceTooSmall(InvalidProblem):
    """The workspace handed to ``plan.run`` is smaller than ``plan.workspace_size()``."""

    def __init__(self, needed: int, got: int, operand: str = "workspace"):
        self.needed = int(needed)
        self.got = int(got)
        super().__init__(
            f"{operand} holds {self.got} bytes but this plan needs {self.needed}; "
            f"pass a buffer of at least plan.workspace_size() = {self.needed} bytes "
            f"(or workspace=None to let the plan allocate it)"
        )


class BufferTooSmall(InvalidProblem):
    """An output or auxiliary buffer holds fewer elements than the op writes."""

    def __init__(self, needed: int, got: int, operand: str = "buffer"):
        self.needed = int(needed)
        self.got = int(got)
        super().__init__(
            f"{operand} holds {self.got} elements but the op writes {self.needed}; "
            f"allocate {operand} with {self.needed} elements (or leave it None)"
        )


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
