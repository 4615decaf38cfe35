"""The grouped experts' kernels as custom ops, for ``torch.compile``.

``Sparse24Experts``' grouped forward launches a Triton routing kernel and two NVRTC kernels by raw pointers. Traced,
each of those would break the graph (``data_ptr``, ctypes), and ``fullgraph=True`` would fail. Under tracing the
forward calls them through these ops instead, which a compiled graph holds as nodes. Eager calls skip the ops, as
``plain_eager`` does for the other kernels: the dispatcher's round trip is host time.

The grouped forward runs only without autograd (the grouped kernel has no backward: ``Sparse24Experts.grouped``), so
the ops have no autograd formula (``_ops.inference_op``), as ``kernelplan::sparse24_linear_inference``: a compiled
graph's call reaches the body without custom_op's Python autograd and aliasing layers.

The kernels are imported when an op runs, never at import (they need Triton and cuda-bindings).
"""

from __future__ import annotations

import torch

from .._ops import inference_op


def _route(ids, weights, x, experts, y, weigh="outputs"):  # the dispatcher leaves out an argument at its default
    """``kernels.moe_route.route``: ``(xs, order, offsets, scale)``; with ``y``, its rows of unrouted pairs zeroed."""
    from ..kernels.moe_route import route

    return route(ids, weights, x, experts, y, weigh)


def _route_fake(ids, weights, x, experts, y, weigh="outputs"):
    pairs = ids.numel()
    return (x.new_empty(pairs, x.shape[1]), ids.new_empty(pairs, dtype=torch.int64),
            ids.new_empty(experts + 1, dtype=torch.int32), x.new_empty(pairs, dtype=torch.float32))


def _grouped(x, values, metadata, bias, offsets, experts, epilogue):
    """``kernels.sparse24_grouped.grouped_linear`` into a new y."""
    from ..kernels.sparse24_grouped import grouped_linear as launch

    return launch(x, values, metadata, bias, offsets, experts, epilogue)


def _grouped_fake(x, values, metadata, bias, offsets, experts, epilogue):
    from ..kernels.sparse24_grouped import output_columns

    return x.new_empty(x.shape[0], output_columns(values, experts, epilogue))


def _scatter(x, values, metadata, bias, offsets, experts, y, rows, scale):
    """``kernels.sparse24_grouped.grouped_linear`` with ``scatter=(y, rows, scale)``: each row into ``y`` where its
    pair goes, times its routing weight."""
    from ..kernels.sparse24_grouped import grouped_linear as launch

    launch(x, values, metadata, bias, offsets, experts, scatter=(y, rows, scale))


def _scatter_fake(x, values, metadata, bias, offsets, experts, y, rows, scale):
    return None


moe_route = inference_op("moe_route(Tensor ids, Tensor weights, Tensor x, int experts, Tensor(a!)? y, "
                         "str weigh=\"outputs\") "
                         "-> (Tensor, Tensor, Tensor, Tensor)", _route, _route_fake)
grouped_linear = inference_op("grouped_linear(Tensor x, Tensor values, Tensor metadata, Tensor? bias, "
                              "Tensor offsets, int experts, str? epilogue) -> Tensor", _grouped, _grouped_fake)
grouped_linear_scatter = inference_op("grouped_linear_scatter(Tensor x, Tensor values, Tensor metadata, "
                                     "Tensor? bias, Tensor offsets, int experts, Tensor(a!) y, Tensor rows, "
                                     "Tensor scale) -> ()", _scatter, _scatter_fake)
