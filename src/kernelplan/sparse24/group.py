"""Sibling layers' GEMM as one op of a compiled graph: ``kernelplan::sparse24_linear_group``.

Eagerly, sibling 2:4 layers that read one input (q/k/v, gate/up: ``nn/siblings.py``) run one GEMM on buffers their
weights were laid end to end in, and each call first checks that the members still lie there.  A traced graph
holds the buffers as its inputs and cannot see the members leave them (``.to()``, ``load_state_dict(assign=True)``,
a deep copy) without guards on every member, which cost more host time on each call of a compiled model than the
fused calls saved (docs/design/0076).  So the op takes the buffers and makes that check itself, per call, through
the group that laid them out (``register``):

* where the members still lie in the buffers, one GEMM on them (through the eager fast path's kept entries,
  ``gemm._sparse24_linear_impl``), under the epilogue (a gated MLP's gate and up);
* otherwise each member's own GEMM on its own tensors, their outputs side by side and the epilogue applied after,
  with a warning: right, and as slow as the layers without a group, until an eager call lays them out again.

``CALLS`` counts the calls of each kind.  The op has no autograd formula: traced calls take it only where grad mode
is off (each member's gradient is its own), as eager calls take the group only where no gradient is recorded.
"""

from __future__ import annotations

import weakref
from typing import Optional, Protocol

import torch

from .._checks import warn_once
from ..activations import ACTIVATIONS, GATED_EPILOGUES
from ..dtypes import dtype_info
from ..errors import InvalidProblem
from .gemm import _linear_fake, _sparse24_linear_impl

CALLS = {"fused": 0, "alone": 0}


class Owner(Protocol):
    """What laid a group's buffers out (``nn/siblings.py``'s group)."""

    def on_buffers(self, values: torch.Tensor) -> bool:
        """Whether ``values`` is its values buffer and every member still lies in its buffers as laid out."""

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's own GEMM on ``x``, their outputs side by side."""


_OWNERS: dict[int, weakref.ref] = {}  # id of a group's values buffer -> its owner, weakly


def register(values: torch.Tensor, owner: Owner) -> None:
    """``values`` is a buffer ``owner`` laid its members' values out in; dropped with the buffer."""
    _OWNERS[id(values)] = weakref.ref(owner)
    weakref.finalize(values, _OWNERS.pop, id(values), None)


def apply_epilogue(z: torch.Tensor, epilogue: str) -> torch.Tensor:
    """``epilogue`` (an activation or a gated epilogue, ``activations.py``) of a pre-activation ``z``, in its
    dtype's compute precision."""
    fn = GATED_EPILOGUES[epilogue].fn if epilogue in GATED_EPILOGUES else ACTIVATIONS[epilogue].fn
    return fn(z.to(dtype_info(z.dtype).compute)).to(z.dtype)


def _group_impl(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: Optional[torch.Tensor],
                epilogue: str, memory: str) -> torch.Tensor:
    ref = _OWNERS.get(id(values))
    owner = ref() if ref is not None else None
    if owner is None:
        raise InvalidProblem(
            "values is no sibling group's buffer: kernelplan::sparse24_linear_group runs the GEMM of a group laid out "
            "by kernelplan.nn.fuse_siblings; for a weight of your own call kernelplan.sparse24.linear"
        )
    if owner.on_buffers(values):
        CALLS["fused"] += 1
        return _sparse24_linear_impl(x, values, metadata, bias, epilogue, memory)
    CALLS["alone"] += 1
    warn_once("a sibling group's members are no longer where the group laid them out (moved since: .to(), "
              "load_state_dict(assign=True), a deep copy); a compiled graph runs each member's GEMM alone until an "
              "eager call of the model lays the group out again")
    z = owner.alone(x)
    return apply_epilogue(z, epilogue) if epilogue else z


_LIBRARY = torch.library.Library("kernelplan", "FRAGMENT")
_LIBRARY.define("sparse24_linear_group(Tensor x, Tensor values, Tensor metadata, Tensor? bias, str epilogue, "
                "str memory) -> Tensor")
_LIBRARY.impl("sparse24_linear_group", _group_impl, "CompositeExplicitAutograd")
torch.library.register_fake("kernelplan::sparse24_linear_group", _linear_fake, lib=_LIBRARY)
group_op = torch.ops.kernelplan.sparse24_linear_group.default
