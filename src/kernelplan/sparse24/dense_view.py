"""A 2:4 layer's ``weight`` as model code reads it: a tensor of the dense shape, dtype and device, with no dense copy.

Hugging Face's modelling code reads a linear layer's ``weight`` outside its forward: T5's feed-forward casts its
input to ``wo.weight.dtype`` on every call, PEFT reads the device and dtype off ``base_layer.weight``.  A
``Sparse24Linear`` holds ``values`` and ``metadata``, not a dense weight, and had no ``weight``: a sparsified T5
raised AttributeError in its forward.

``DenseView`` answers what such code reads (``shape``, ``dtype``, ``device``, ``isinstance(w, torch.Tensor)``) from
its own metadata, holding only the compressed tensors.  Any op on it (``F.linear(x, layer.weight)``, ``w.sum()``,
``w.clone()``) runs on the weight decompressed for that op, so every result is the weight's, and warns once that it
does (once for each op): a dense copy each time, which a 2:4 layer exists to avoid.  Scaling it in place by a scalar
(``mul_``, ``div_``) scales the layer's kept entries, which keeps it 2:4; any other op that would write it is refused
(it would change the copy).  Read while autograd records (``dense_view``), the view is the output of a function
of ``values``: an op on it gives the kept values their gradient, as the dense weight's would (before, such a read
gave none, and a training step silently left the layer out).  Traced (``torch.compile``), the layer gives the
decompressed weight as ops of the graph instead, which the compiler drops where only its dtype or shape is read.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .._checks import warn_once
from ..errors import InvalidProblem
from .format import Sparse24Weight
from .layout import SP_LAYOUT, layout_of, pack_values, weight_shape


class DenseView(torch.Tensor):
    """The dense ``[M, K]`` weight of 2:4 ``values`` and ``metadata`` (either layout), decompressed per op."""

    @staticmethod
    def __new__(cls, values: torch.Tensor, metadata: torch.Tensor, k: int | None = None):
        # k: the logical K of a weight the device layout holds padded (Sparse24Weight.k)
        return torch.Tensor._make_wrapper_subclass(cls, (weight_shape(values)[0], k or weight_shape(values)[1]),
                                                   dtype=values.dtype, device=values.device, requires_grad=False)

    def __init__(self, values: torch.Tensor, metadata: torch.Tensor, k: int | None = None):
        self.values, self.metadata, self.k = values, metadata, k

    def __repr__(self) -> str:
        return f"DenseView(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, 2:4)"

    def dense(self) -> torch.Tensor:
        with torch.no_grad():
            return Sparse24Weight(self.values.detach(), self.metadata, k=self.k, _validate=False).decompress()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALINGS and not kwargs and isinstance(args[0], DenseView) and _scalar(args[1]):
            func(args[0].values, args[1])  # a weight scaled in place: its kept entries, its mask unchanged
            return args[0]
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, DenseView) and arg.alias_info is not None and arg.alias_info.is_write:
                raise InvalidProblem(  # it would change a copy made for the op, not the layer
                    f"{func} would write a 2:4 layer's weight, which is held as values and metadata: change "
                    f"layer.values (its kept entries; the mask in layer.metadata stays), or build a new layer from a "
                    f"dense weight with Sparse24Linear.from_dense")
        warn_once(f"an op ({func}) read a 2:4 layer's weight: it ran on the weight decompressed, a dense copy made "
                  f"for it (kernelplan.sparse24.dense_view)")
        return func(*tree_map(_dense, args), **tree_map(_dense, kwargs))


def dense_view(values: torch.Tensor, metadata: torch.Tensor, k: int | None = None) -> DenseView:
    """A layer's ``weight``: a ``DenseView``, differentiable in ``values`` where autograd records and they require
    grad."""
    if torch.is_grad_enabled() and values.requires_grad:
        return _Differentiable.apply(values, metadata, k)
    return DenseView(values, metadata, k)


class _Differentiable(torch.autograd.Function):
    """``values -> DenseView``: the dense gradient of an op on the view, gathered at the kept positions into the
    layout ``values`` are held in (the mask's other entries get none: it stays fixed)."""

    @staticmethod
    def forward(ctx, values, metadata, k):
        ctx.save_for_backward(values, metadata)
        ctx.k = k
        return DenseView(values, metadata, k)

    @staticmethod
    def backward(ctx, grad):
        values, metadata = ctx.saved_tensors
        w24 = Sparse24Weight(values.detach(), metadata, k=ctx.k, _validate=False)
        dvalues = torch.gather(grad, 1, w24.positions()).to(values.dtype)
        return (pack_values(dvalues) if layout_of(values) == SP_LAYOUT else dvalues), None, None


# In-place scalings, which keep a 2:4 weight 2:4: RWKV's eval forward rescales its layers' weights this way.
_SCALINGS = frozenset({torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar, torch.ops.aten.div_.Tensor,
                       torch.ops.aten.div_.Scalar})


def _scalar(other) -> bool:
    """A Python number or a one-element tensor that is not itself a 2:4 layer's weight."""
    if isinstance(other, torch.Tensor):
        return other.numel() == 1 and not isinstance(other, DenseView)
    return isinstance(other, (int, float))


def _dense(t):
    return t.dense() if isinstance(t, DenseView) else t
