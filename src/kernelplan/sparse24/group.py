"""Sibling layers' GEMM as one op of a compiled graph: ``kernelplan::sparse24_linear_group``.

Eagerly, sibling 2:4 layers that read one input (q/k/v, gate/up: ``nn/siblings.py``) run one GEMM on buffers
their weights were laid end to end in.  A traced graph cannot hold those buffers: its inputs are the members' own
tensors, which a later ``.to()``, ``load_state_dict(assign=True)`` or deep copy moves off the buffers without the
graph knowing.  So the op takes the members' tensors and computes what they compute, their outputs side by side
(under an epilogue, the epilogue of that: a gated MLP's gate and up), and decides per call how:

* where every member tensor is the one the group laid out and still lies where it was laid (``laid_out``), one GEMM
  on the group's buffers, through the eager fast path's kept entries (``gemm._sparse24_linear_impl``);
* otherwise each member's own GEMM, their outputs concatenated and the epilogue applied after, with a warning:
  right, and as slow as the layers without a group, until an eager call lays the group out again.

``CALLS`` counts the calls of each kind.  The op has no autograd formula: traced calls take it only where no
gradient is needed (each member's gradient is its own), as eager calls take the group.
"""

from __future__ import annotations

import weakref

import torch

from .._checks import warn_once
from ..activations import ACTIVATIONS, GATED_EPILOGUES, epilogue_columns
from ..dtypes import dtype_info
from ..errors import InvalidProblem
from .gemm import _sparse24_linear_impl
from .layout import weight_shape

CALLS = {"fused": 0, "alone": 0}


class _Laid:
    """Where a group laid its members out: each member tensor (weakly) and its data pointer, in the op's order
    (values, metadata, bias), and the group's buffers (weakly: the group holds them)."""

    __slots__ = ("tensors", "ptrs", "buffers")

    def __init__(self, tensors: list, buffers: list):
        self.tensors = [weakref.ref(t) for t in tensors]
        self.ptrs = [t.data_ptr() for t in tensors]
        self.buffers = [None if b is None else weakref.ref(b) for b in buffers]

    def holds(self, tensors: list) -> bool:
        """Whether ``tensors`` are the ones laid out, each where it was laid (``.data = ...``, as Module._apply and
        ``.to()`` do, keeps a Parameter and moves its storage)."""
        if len(tensors) != len(self.tensors):
            return False
        for t, ref, ptr in zip(tensors, self.tensors, self.ptrs):
            if ref() is not t or t.data_ptr() != ptr:
                return False
        return True


_LAID: dict[int, _Laid] = {}  # id of the first member's values -> _Laid


def laid_out(values: list, metadata: list, bias: list | None, buffers: list) -> None:
    """Record that the members' tensors (``bias`` None for members without one) are views of ``buffers`` (values,
    metadata, bias or None), the members' rows end to end in that order."""
    key = id(values[0])
    if key not in _LAID:  # one finalizer a first member, however often its group is laid out again
        weakref.finalize(values[0], _LAID.pop, key, None)
    _LAID[key] = _Laid([*values, *metadata, *(bias or ())], buffers)


def _buffers(values: list, metadata: list, bias: list) -> list | None:
    """The group's buffers, where these are the tensors it laid out and each still lies where it was laid."""
    laid = _LAID.get(id(values[0]))
    if laid is None or not laid.holds([*values, *metadata, *bias]):
        return None
    buffers = [None if ref is None else ref() for ref in laid.buffers]
    return None if buffers[0] is None or buffers[1] is None else buffers


def _check_lists(values: list, metadata: list, bias: list) -> None:
    if not values or len(metadata) != len(values) or len(bias) not in (0, len(values)):
        raise InvalidProblem(
            f"a sibling group's op got {len(values)} values, {len(metadata)} metadata and {len(bias)} biases; it "
            f"takes one values and one metadata tensor a member (at least one member) and a bias for every member "
            f"or for none"
        )


def _group_impl(x: torch.Tensor, values: list, metadata: list, bias: list, epilogue: str,
                memory: str) -> torch.Tensor:
    _check_lists(values, metadata, bias)
    buffers = _buffers(values, metadata, bias)
    if buffers is not None:
        CALLS["fused"] += 1
        return _sparse24_linear_impl(x, *buffers, epilogue, memory)
    CALLS["alone"] += 1
    if len(values) > 1:
        warn_once("a sibling group's members are no longer where the group laid them out (moved since: .to(), "
                  "load_state_dict(assign=True), a deep copy); a compiled graph runs each member's GEMM alone "
                  "until an eager call of the model lays the group out again")
    members = zip(values, metadata, bias or [None] * len(values))
    z = torch.cat([_sparse24_linear_impl(x, v, m, b, "", memory) for v, m, b in members], -1)
    if not epilogue:
        return z
    fn = GATED_EPILOGUES[epilogue].fn if epilogue in GATED_EPILOGUES else ACTIVATIONS[epilogue].fn
    return fn(z.to(dtype_info(z.dtype).compute)).to(z.dtype)


def _group_fake(x, values, metadata, bias, epilogue, memory):
    _check_lists(values, metadata, bias)
    rows = sum(weight_shape(v)[0] for v in values)
    return x.new_empty((*x.shape[:-1], epilogue_columns(rows, epilogue or None)))


_LIBRARY = torch.library.Library("kernelplan", "FRAGMENT")
_LIBRARY.define("sparse24_linear_group(Tensor x, Tensor[] values, Tensor[] metadata, Tensor[] bias, str epilogue, "
                "str memory) -> Tensor")
_LIBRARY.impl("sparse24_linear_group", _group_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kernelplan::sparse24_linear_group", _group_fake, lib=_LIBRARY)
_group_op = torch.ops.kernelplan.sparse24_linear_group.default


def group_linear(x: torch.Tensor, values: list, metadata: list, bias: list | None, epilogue: str | None,
                 memory: str) -> torch.Tensor:
    """The members' outputs side by side under ``epilogue`` (see the module docstring): the traced call of a group.
    ``bias`` None for members without one."""
    return _group_op(x, list(values), list(metadata), list(bias) if bias is not None else [], epilogue or "", memory)
