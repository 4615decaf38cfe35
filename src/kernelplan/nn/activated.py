"""MLPs with one activation, ``act(dense(x))`` or ``fc2(act(fc1(x)))``, with the activation in the 2:4 GEMM's epilogue.

BERT's and ViT's intermediate layers compute ``act(dense(x))``; the MLPs of Phi-2, GPT-NeoX, Falcon and CLIP's
text tower ``fc2(act(fc1(x)))``.  The 2:4 kernels apply an activation in their epilogue (``kp.sparse24.linear``'s
``activation=``), so the pre-activation is never written and read back, and the activation is not a kernel of its
own.

Found by what a module holds, not by names: its children are one or two 2:4 layers (``Sparse24Linear`` in the
device layout, in no sibling group), exactly one activation (a child without parameters or buffers whose values on
a probe are one of the kernels' activations: ``gated_siblings.activation_of``), and nothing else with parameters
or buffers.  With two layers, the first registered is fc1 and fc1's rows must be fc2's inputs; an ``nn.Sequential``
must hold fc1, the activation[, fc2] in that order, and dropouts (which the route, in eval mode only, may skip).
What a module holds does not say what its forward computes, so its first fused call is checked against its own
forward (``nn/routes.py``).

A module in training mode runs its own forward: a dropout the route cannot see (a child, or ``F.dropout`` in the
forward) would be skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..sparse24.layout import PUBLIC
from .gated_siblings import activation_of
from .routes import EpilogueRoute, route_of
from .siblings import siblings_of


def route_activated_mlps(model: nn.Module) -> list["ActivatedMlp"]:
    """Route every module of ``model`` that holds one or two 2:4 layers and one activation (see the module
    docstring); returns the routes.  Idempotent: a module already routed (here, by a group, or by another library's
    hook) is left as it is."""
    from .sparse24_linear import Sparse24Linear

    out = []
    for mod in model.modules():
        if "forward" in mod.__dict__:
            continue
        layers, bare, other = [], [], False
        for child in mod.children():
            if isinstance(child, Sparse24Linear):
                layers.append(child)
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                other = True  # a layer of another kind, a norm, a rotary embedding's tables, a container
            else:
                bare.append(child)
        if other or not 1 <= len(layers) <= 2:
            continue
        found = [(child, activation_of(child)) for child in bare]  # probed only here, once a child
        found = [(child, name) for child, name in found if name is not None]
        if len(found) != 1:
            continue
        act, act_name = found[0]
        if isinstance(mod, nn.Sequential) and \
                [c for c in mod if not isinstance(c, nn.Dropout)] != [layers[0], act, *layers[1:]]:
            continue  # a Sequential runs its children in order: first, activation[, second], and dropouts
        if any(layer.layout == PUBLIC or siblings_of(layer) is not None for layer in layers):
            continue
        if len(layers) == 2 and layers[0].out_features != layers[1].in_features:
            continue
        out.append(ActivatedMlp(mod, act_name, *layers))
    return out


def activated_mlp_of(mod: nn.Module) -> "ActivatedMlp | None":
    """The route of a module (``route_activated_mlps``), or None."""
    return route_of(mod, ActivatedMlp)


class ActivatedMlp(EpilogueRoute):
    """An MLP's route: its first layer's GEMM with the activation in the epilogue, then its second layer, if any."""

    HOW = "with its activation in the GEMM's epilogue"

    def __init__(self, mod: nn.Module, activation: str, first: nn.Module, second: nn.Module | None = None):
        self.activation, self.first, self.second = activation, first, second
        super().__init__(mod)

    def __repr__(self) -> str:
        return (f"ActivatedMlp({type(self.mod).__name__}, {self.activation!r}, off={self.off!r}, "
                f"stats={self.stats})")

    def what(self) -> str:
        inner = f"{self.activation}(first(x))"
        return f"second({inner})" if self.second is not None else inner

    def epilogue_layer(self):
        return self.first, self.first.out_features, self.activation

    def epilogue_gemm(self, x: torch.Tensor, capturing: bool | None = None) -> torch.Tensor | None:
        return self.layer_gemm(self.first, x, self.activation, capturing)

    def call_fused(self, x: torch.Tensor, capturing: bool) -> torch.Tensor | None:
        if self.mod.training:
            return None
        h = self.epilogue_gemm(x, capturing)
        if h is None or self.second is None:
            return h
        return self.second(h)
