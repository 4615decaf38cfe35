"""Hugging Face's gated MLPs (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) on one GEMM with a gated epilogue.

Llama, Qwen2, Mistral, Gemma and others write their feed-forward block as modules named ``gate_proj``,
``up_proj``, ``down_proj`` and ``act_fn``.  Once ``fuse_siblings`` has grouped gate_proj and up_proj (they read one
input: nn/siblings.py), their weights lie end to end, gate rows first: the weight of
``kernelplan.sparse24.gated_linear``.  Phi-3 holds that weight as one layer already: ``gate_up_proj``, with
``down_proj`` and ``activation_fn`` (``up * act(gate)`` of its output's halves, gate first).  Its kernels apply
``act(gate) * up`` in their epilogue, so the MLP's [N, 2 x intermediate] pre-activation is never written or read
back, and the silu and the product are not two more kernels.  Unlike the group's own GEMM, whose members take
strided columns of its output, the gated output is contiguous: it runs at any number of rows of x.

``route_gated_mlps`` gives each such module a route (``nn/routes.py``: its first fused call is checked against
the module's own forward).  The names only propose: a module whose act_fn is not one of the kernels' activations,
identified by its values on a probe, is not routed.  The module's own forward also runs:
* under autograd (each layer its own op, as without a group);
* until gate_proj and up_proj have settled as one group of those two, gate first (Phi-3's form needs no group);
* wherever the group's GEMM would run alone (``_Group.gated``: an x a layer refuses, a capture before the gated
  GEMM has run eagerly, a broken group).

``GatedMlp.stats`` counts the calls of each kind.
"""

from __future__ import annotations

import torch
from torch import nn

from ..activations import ACTIVATIONS
from .routes import EpilogueRoute, route_of
from .siblings import SPECS, siblings_of

NAMES = ("gate_proj", "up_proj", "down_proj", "act_fn")
FUSED_NAMES = ("gate_up_proj", "down_proj", "activation_fn")  # Phi-3's
# The activations the kernels' gated epilogue applies, in the order the probe tries them.
_ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu", "sigmoid", "quick_gelu")


def activation_of(fn) -> str | None:
    """Which of the kernels' activations ``fn`` computes, from its values on a probe in fp32; None if none."""
    probe = torch.linspace(-8.0, 8.0, 161)
    if isinstance(fn, nn.Module):
        fn = fn.forward  # not the module's call: its hooks are the user's, not for a probe
    try:
        with torch.no_grad():
            got = fn(probe.clone())
    except Exception:  # noqa: BLE001  any module that cannot run on a CPU tensor is simply not one of them
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    for name in _ACTIVATIONS:
        want = ACTIVATIONS[name].fn(probe.double())
        if torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6):
            return name
    return None


def route_gated_mlps(model: nn.Module) -> list["GatedMlp"]:
    """Route every gated MLP of ``model`` whose gate and up projections are candidates of one ``Siblings`` of a kind
    with a gated epilogue (see the module docstring); returns the routes.  Idempotent."""
    from .sparse24_linear import Sparse24Linear
    from ..sparse24.layout import PUBLIC

    out = []
    for mod in model.modules():
        if "forward" in mod.__dict__:
            continue  # already routed (here, by a group, or by another library's hook)
        if all(hasattr(mod, n) for n in FUSED_NAMES):
            layer = mod.gate_up_proj
            if isinstance(layer, Sparse24Linear) and layer.layout != PUBLIC and layer.out_features % 32 == 0:
                act = activation_of(mod.activation_fn)
                if act is not None:
                    out.append(GatedMlp(mod, act, fused=True))
            continue
        if not all(hasattr(mod, n) for n in NAMES):
            continue
        gate, up = mod.gate_proj, mod.up_proj
        siblings = siblings_of(gate)
        spec = SPECS.get(type(gate))
        if siblings is None or siblings is not siblings_of(up) or spec is None or spec.gated is None or \
                gate.out_features != up.out_features or gate.out_features % 16:
            continue
        act = activation_of(mod.act_fn)
        if act is not None:
            out.append(GatedMlp(mod, act))
    return out


def gated_mlp_of(mod: nn.Module) -> "GatedMlp | None":
    """The route of a module (``route_gated_mlps``), or None."""
    return route_of(mod, GatedMlp)


class GatedMlp(EpilogueRoute):
    """A gated MLP's route: its gate/up group's GEMM with the gated epilogue, then down_proj."""

    HOW = "on one gated GEMM"

    def __init__(self, mlp: nn.Module, activation: str, fused: bool = False):
        self.mlp, self.activation, self.fused = mlp, activation, fused  # fused: Phi-3's gate_up_proj
        self.epilogue = f"gated_{activation}_first"  # the rows: gate_proj's (or gate_up_proj's first half), then up's
        self._settled = None  # the group, once found: a settled Siblings keeps its groups
        super().__init__(mlp)

    def __repr__(self) -> str:
        return f"GatedMlp({type(self.mlp).__name__}, {self.epilogue!r}, off={self.off!r}, stats={self.stats})"

    def what(self) -> str:
        return f"down_proj({self.activation}(gate_proj(x)) * up_proj(x))"

    def group(self):
        """gate_proj and up_proj's group, settled as exactly those two with gate first; else None."""
        if self._settled is None:
            mlp = self.mlp
            siblings = siblings_of(mlp.gate_proj)
            for g in (siblings.groups or ()) if siblings is not None else ():
                if len(g.members) == 2 and g.members[0] is mlp.gate_proj and g.members[1] is mlp.up_proj:
                    self._settled = g
        return self._settled

    def ready(self) -> bool:
        return self.fused or self.group() is not None

    def epilogue_layer(self):
        if self.fused:
            return self.mlp.gate_up_proj, self.mlp.gate_up_proj.out_features, self.epilogue
        return self.mlp.gate_proj, 2 * self.mlp.gate_proj.out_features, self.epilogue

    def epilogue_gemm(self, x: torch.Tensor, capturing: bool | None = None) -> torch.Tensor | None:
        return self.gated(x, capturing)

    def gated(self, x: torch.Tensor, capturing: bool | None = None) -> torch.Tensor | None:
        """act(gate) * up of x by one GEMM, or None where it cannot run now (``_Group.gated`` says when; Phi-3's
        layer: under autograd, for an x it refuses, or in a capture before its first eager call)."""
        if not self.fused:
            group = self.group()
            return group.gated(x, self.epilogue, capturing) if group is not None else None
        return self.layer_gemm(self.mlp.gate_up_proj, x, self.epilogue, capturing)

    def call_fused(self, x: torch.Tensor, capturing: bool) -> torch.Tensor | None:
        h = self.gated(x, capturing)
        return self.mlp.down_proj(h) if h is not None else None
