"""``GatedMLP``: the feed-forward block of Llama/PaLM-style transformers."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import choice
from ..errors import InvalidProblem
from ..gated import APPROXIMATIONS, GATES, KINDS, gated_activation
from ..sparse24.layout import PUBLIC
from .sparse24_linear import Sparse24Linear


class GatedMLP(nn.Module):
    """``down(gated_activation(gate_up(x)))``, with one fused gate/up projection.

    ``gate_up`` maps ``dim -> 2 * hidden``; its output is split in half along the
    last dim and gated by :func:`kernelplan.gated_activation` (``kind``, ``gate``),
    then ``down`` maps ``hidden -> dim``.  With ``gate="first"`` the first half
    goes through the activation: Llama's ``down(silu(gate(x)) * up(x))`` is
    ``kind="swiglu", gate="first"`` with ``gate_up.weight = cat([gate.weight, up.weight])``
    (see :meth:`from_projections`).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        kind: str = "swiglu",
        gate: str = "first",
        approximate: str = "none",
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidProblem(f"{name} is {value!r}; it must be a positive int")
        self.kind = choice(kind, "kind", KINDS)
        self.gate = choice(gate, "gate", GATES)
        self.approximate = choice(approximate, "approximate", APPROXIMATIONS)
        if self.approximate != "none" and self.kind != "geglu":
            raise InvalidProblem(
                f"approximate is {approximate!r} with kind {kind!r}; only geglu has a tanh approximation"
            )
        self.dim, self.hidden = dim, hidden
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_projections(
        cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, kind: str = "swiglu"
    ) -> "GatedMLP":
        """Build from separate gate/up/down projections (Hugging Face Llama's ``LlamaMLP`` layout)."""
        if gate_proj.weight.shape != up_proj.weight.shape:
            raise InvalidProblem(
                f"gate_proj.weight has shape {tuple(gate_proj.weight.shape)} but up_proj.weight has "
                f"{tuple(up_proj.weight.shape)}; the two projections must match"
            )
        hidden, dim = gate_proj.weight.shape
        if tuple(down_proj.weight.shape) != (dim, hidden):
            raise InvalidProblem(
                f"down_proj.weight has shape {tuple(down_proj.weight.shape)}; it must be ({dim}, {hidden}) "
                f"to map the hidden width back to the model width"
            )
        biases = [p.bias is not None for p in (gate_proj, up_proj, down_proj)]
        if len(set(biases)) != 1:
            raise InvalidProblem(f"bias presence differs between gate/up/down projections ({biases}); all or none")
        w = gate_proj.weight
        mlp = cls(dim, hidden, kind=kind, gate="first", bias=biases[0], device=w.device, dtype=w.dtype)
        with torch.no_grad():
            mlp.gate_up.weight.copy_(torch.cat([gate_proj.weight, up_proj.weight]))
            mlp.down.weight.copy_(down_proj.weight)
            if biases[0]:
                mlp.gate_up.bias.copy_(torch.cat([gate_proj.bias, up_proj.bias]))
                mlp.down.bias.copy_(down_proj.bias)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses_gate():
            # One GEMM: the kernels apply the gated activation in their epilogue (kernelplan.sparse24.gated_linear).
            return self.down(self.gate_up.gated(x, self.kind, self.gate, self.approximate))
        h = gated_activation(self.gate_up(x), self.kind, dim=-1, gate=self.gate, approximate=self.approximate)
        return self.down(h)

    def fuses_gate(self) -> bool:
        """Whether ``gate_up`` applies the gated activation in its GEMM's epilogue: a 2:4 layer (after
        ``kp.sparsify``) held in the device layout, each half whole 16-row tiles."""
        g = self.gate_up
        return isinstance(g, Sparse24Linear) and g.layout != PUBLIC and g.out_features % 32 == 0

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, hidden={self.hidden}, kind={self.kind!r}, gate={self.gate!r}"
            + (f", approximate={self.approximate!r}" if self.approximate != "none" else "")
        )
