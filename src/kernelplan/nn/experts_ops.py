"""The grouped experts' kernels as custom ops, for ``torch.compile``.

``Sparse24Experts``' grouped forward launches a Triton routing kernel and two NVRTC kernels by raw pointers. Traced,
each of those would break the graph (``data_ptr``, ctypes), and ``fullgraph=True`` would fail. Under tracing the
forward calls them through these ops instead, which a compiled graph holds as nodes. Eager calls skip the ops, as
``plain_eager`` does for the other kernels: the dispatcher's round trip is host time.

The kernels are imported when an op runs, never at import (they need Triton and cuda-bindings).
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("kernelplan::moe_route", mutates_args=("y",))
def moe_route(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, experts: int,
              y: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.moe_route.route``: ``(xs, order, offsets, scale)``; with ``y``, its rows of unrouted pairs zeroed."""
    from ..kernels.moe_route import route

    return route(ids, weights, x, experts, y)


@moe_route.register_fake
def _(ids, weights, x, experts, y):
    pairs = ids.numel()
    return (x.new_empty(pairs, x.shape[1]), ids.new_empty(pairs, dtype=torch.int64),
            ids.new_empty(experts + 1, dtype=torch.int32), x.new_empty(pairs, dtype=torch.float32))


@torch.library.custom_op("kernelplan::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: Optional[torch.Tensor],
                   offsets: torch.Tensor, experts: int, epilogue: Optional[str]) -> torch.Tensor:
    """``kernels.sparse24_grouped.grouped_linear`` into a new y."""
    from ..kernels.sparse24_grouped import grouped_linear as launch

    return launch(x, values, metadata, bias, offsets, experts, epilogue)


@grouped_linear.register_fake
def _(x, values, metadata, bias, offsets, experts, epilogue):
    from ..kernels.sparse24_grouped import output_columns

    return x.new_empty(x.shape[0], output_columns(values, experts, epilogue))


@torch.library.custom_op("kernelplan::grouped_linear_scatter", mutates_args=("y",))
def grouped_linear_scatter(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor,
                           bias: Optional[torch.Tensor], offsets: torch.Tensor, experts: int, y: torch.Tensor,
                           rows: torch.Tensor, scale: torch.Tensor) -> None:
    """``kernels.sparse24_grouped.grouped_linear`` with ``scatter=(y, rows, scale)``: each row into ``y`` where its
    pair goes, times its routing weight."""
    from ..kernels.sparse24_grouped import grouped_linear as launch

    launch(x, values, metadata, bias, offsets, experts, scatter=(y, rows, scale))


@grouped_linear_scatter.register_fake
def _(x, values, metadata, bias, offsets, experts, y, rows, scale):
    return None
