"""A module's calls routed to 2:4 GEMMs with an epilogue (or its chosen experts), checked against its own forward.

Three kinds of route share this: gated MLPs (``nn/gated_siblings.py``: ``down(act(gate) * up)`` on one GEMM with a
gated epilogue), MLPs with one activation (``nn/activated.py``: ``act(dense(x))`` or ``fc2(act(fc1(x)))`` with
the activation in fc1's epilogue) and Llama-4's MoE layers (``nn/moe_routes.py``: each token through the experts its
router chose alone).  Each is found by what a module holds, and what a module holds does not say what
its forward computes.  So the first fused call of each module is compared with the module's own forward on the same
input; a module whose results differ goes back to its own forward for good, with a warning.

A route is the module's instance ``forward``, which Module.__call__ finds before the class's; it holds no tensors,
so state dicts are unchanged.  The module's own forward runs:
* under torch.compile (each layer its own op, as without a route), or for calls of other than one input;
* wherever the subclass's ``call_fused`` returns None (autograd, an input a layer refuses, a capture before the
  fused GEMM has run eagerly: the route cannot build a kernel inside a capture);
* for the first call, when it falls inside a CUDA graph capture (the check needs the two results);
* while a child of the module is not the one it held when routed (a PEFT adapter wrapping gate_proj, a user's swap):
  the fused GEMMs read the layers the route was built on, so they would compute the old function.  The route runs
  again once the children are back (PEFT's ``unload``).
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import _is_compiling, plain_eager, warn_once
from ..kernels import stream_capturing

# The first fused call against the module's own forward: an error of rounding (bf16's is 2^-8 of a value, and the
# two paths round the pre-activation differently) against one of a different function (order 1).
CHECK_REL_TOL = 0.05


def route_of(mod: nn.Module, kind: type | None = None) -> "EpilogueRoute | None":
    """The route of a module (``EpilogueRoute``; of that ``kind`` where given), or None."""
    route = mod.__dict__.get("_epilogue_route")
    return route if kind is None or isinstance(route, kind) else None


class EpilogueRoute:
    """The calls of ``mod`` on fused GEMMs.  A subclass gives ``call_fused`` (the module's result by them, or None),
    ``epilogue_layer``, ``epilogue_gemm`` and ``ready`` (what ``kp.warmup`` compiles and runs), ``what`` (the
    function the fused GEMMs compute, named in the warning of a mismatch) and ``HOW`` (how the route runs it)."""

    HOW = "with a fused epilogue"

    def __init__(self, mod: nn.Module):
        self.mod = mod
        self.checked = False  # the first fused call matched the module's own forward
        self.warmed = False  # the epilogue's GEMM has run outside a capture (a capture may not build its kernel)
        self.off: str | None = None  # why this module runs its own forward for good
        self.stats = {"fused": 0, "own": 0}
        self.children = tuple(mod._modules.items())  # by identity: what the fused GEMMs read
        mod.__dict__["forward"] = self.forward
        mod.__dict__["_epilogue_route"] = self

    def what(self) -> str:
        raise NotImplementedError

    def call_fused(self, x: torch.Tensor, capturing: bool) -> torch.Tensor | None:
        """The module's result on ``x`` by the fused GEMMs, or None; ``capturing``: x is on a stream being captured
        (asked once a call: a CUDA call each time)."""
        raise NotImplementedError

    def epilogue_layer(self):
        """``(layer, rows, epilogue)``: the layer whose weight the epilogue's GEMM reads, its rows, the epilogue."""
        raise NotImplementedError

    def epilogue_gemm(self, x: torch.Tensor, capturing: bool | None = None) -> torch.Tensor | None:
        """The epilogue's GEMM alone on ``x`` (``kp.warmup`` runs it on zeros); None where it cannot run now.
        ``capturing`` as ``call_fused``'s, asked here where not given."""
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether the epilogue's GEMM can run now (a gated MLP's group may not have settled yet)."""
        return True

    def compared(self, out):
        """The tensor of the module's output that the first call's check compares (a module may return more)."""
        return out

    def detach(self) -> None:
        """Give the module back its class's forward, for good: its layers were replaced by ones the route cannot run
        (``model.dequantize()``)."""
        self.off = "detached"
        self.mod.__dict__.pop("forward", None)
        self.mod.__dict__.pop("_epilogue_route", None)

    def children_replaced(self) -> bool:
        """Whether the module's children are not the ones it held when routed (one replaced, added or removed)."""
        modules = self.mod._modules  # a loop, not any(<generator>): 0.27 us against 1.1 a call on the CI host
        for name, child in self.children:
            if modules.get(name) is not child:
                return True
        return len(modules) != len(self.children)

    @staticmethod
    def capturing(x: torch.Tensor) -> bool:
        return x.is_cuda and stream_capturing()

    def layer_gemm(self, layer: nn.Module, x: torch.Tensor, epilogue: str,
                   capturing: bool | None) -> torch.Tensor | None:
        """``layer``'s own GEMM on ``x`` with ``epilogue``, or None where it cannot run now: an x the layer refuses,
        autograd or a tensor subclass, or a capture before it has run eagerly (a capture may not build its kernel)."""
        if x.dim() == 0 or x.shape[-1] != layer.in_features or not plain_eager(x, layer.values, layer.bias):
            return None
        capturing = self.capturing(x) if capturing is None else capturing
        if capturing and not self.warmed:
            return None
        h = layer.with_epilogue(x, epilogue)
        self.warmed = self.warmed or not capturing
        return h

    def forward(self, *args, **kwargs):
        mod = self.mod
        if _is_compiling():  # first: traced, the route's state is not read, so dynamo guards none of it (0078)
            return type(mod).forward(mod, *args, **kwargs)
        own = type(mod).forward
        if self.off is not None or len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            return own(mod, *args, **kwargs)
        if self.children_replaced():
            self.stats["own"] += 1
            return own(mod, *args)
        x = args[0]
        y = None
        capturing = self.capturing(x)
        if not (self.checked is False and capturing):
            y = self.call_fused(x, capturing)
        if y is None:
            self.stats["own"] += 1
            return own(mod, x)
        if not self.checked:
            want = own(mod, x)
            got, expected = self.compared(y).float(), self.compared(want).float()
            err = float((got - expected).abs().max())
            scale = float(expected.abs().max())
            if not err <= CHECK_REL_TOL * scale + 1e-6:
                self.off = (f"its first fused call differed from its own forward by {err:.3g} (largest value "
                            f"{scale:.3g}): its forward is not {self.what()}")
                warn_once(f"{type(mod).__name__}: not run {self.HOW}: {self.off}")
                self.stats["own"] += 1
                return want
            self.checked = True
        self.stats["fused"] += 1
        return y
