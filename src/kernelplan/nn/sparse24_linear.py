"""``Sparse24Linear``: an nn.Linear whose weight is held 2:4-compressed."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import choice
from ..errors import InvalidProblem
from ..sparse24.dispatch import MEMORY_POLICIES
from .. import sparse24
from ..sparse24 import Sparse24Weight, compress
from ..sparse24.gemm import linear_parts


class Sparse24Linear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` stored as 2:4 values + metadata.

    ``values`` is a Parameter (training updates the kept weights; the mask in
    ``metadata`` stays fixed, so the weight stays 2:4); ``metadata`` is a buffer.
    ``memory`` is the dispatch policy of its calls (``kernelplan.sparse24.linear``):
    "compact" (the one device layout, by rule) or "fast" (every backend timed).
    """

    def __init__(self, values: torch.Tensor, metadata: torch.Tensor, bias: torch.Tensor | None = None,
                 memory: str = "compact"):
        super().__init__()
        self.memory = choice(memory, "memory", MEMORY_POLICIES)
        w24 = Sparse24Weight(values, metadata)  # validates shapes and metadata bits
        self.in_features, self.out_features = w24.shape[1], w24.shape[0]
        self.values = nn.Parameter(values)
        self.register_buffer("metadata", metadata)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear_module: nn.Linear, prune: str = "magnitude") -> "Sparse24Linear":
        """Prune ``linear_module.weight`` by magnitude (2 of every 4 kept) and compress it."""
        if not isinstance(linear_module, nn.Linear):
            raise InvalidProblem(
                f"linear_module is a {type(linear_module).__name__}; from_dense takes an nn.Linear"
            )
        if prune != "magnitude":
            raise InvalidProblem(f"prune is {prune!r}; the one pruning method is prune='magnitude'")
        with torch.no_grad():
            w24 = compress(sparse24.prune(linear_module.weight.detach()))
            bias = linear_module.bias.detach().clone() if linear_module.bias is not None else None
        return cls(w24.values, w24.metadata, bias)

    @property
    def weight24(self) -> Sparse24Weight:
        return Sparse24Weight(self.values, self.metadata, _validate=False)

    def to_dense(self) -> torch.Tensor:
        return self.weight24.decompress()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_parts(x, self.values, self.metadata, self.bias, None, self.memory)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"memory={self.memory!r}")
