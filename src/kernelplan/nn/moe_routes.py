"""A MoE layer whose experts run every token (Llama-4's) sent through the experts its router chose alone.

``Llama4TextMoe`` repeats its T tokens once an expert, scales each copy by the router's score for that expert (zero
for an expert the token did not choose: the sigmoid of -inf) and runs all E x T rows through its experts module,
then sums each token's E outputs (``nn/experts.py``'s ``EVERY_TOKEN``).  A row of zeros gives zeros (no bias), so
the sum is that of the chosen experts' outputs on their scaled copies: the route computes those alone, as the top-k
experts modules do (``Sparse24Experts.routed``).  A decode step then reads the chosen experts' weights, not every
expert's, and a prefill does 1/E of the module's work.

The router's scores are the sigmoid of its top-k logits, in float32 rounded to their dtype (``Llama4Router``).  The
route takes the router's logits and their top k; the routing kernel computes the scores and scales each copy as it
gathers the rows (``weigh="sigmoid inputs"``).  The router's and the route's own ops for those were nine a call: the
scores' buffer, scatter, two conversions and sigmoid, the product and a buffer of ones, a second top-k and its gather.

The route is the module's instance ``forward`` (``nn/routes.py``): its first call is checked against the module's
own forward, and the module's own forward runs under torch.compile, for calls of other than one tensor, while its
children are not the ones it was routed with, and for a first call inside a CUDA graph's capture.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import class_name
from .experts import Sparse24Experts
from .routes import EpilogueRoute, route_of

# The MoE layers the route computes, by class name -> their router's: children router (an nn.Linear whose forward
# gives ``(sigmoid of its top-k logits scattered into [T, E], logits)``, its top_k attribute k), experts (an
# ``EVERY_TOKEN`` module) and shared_expert, attribute hidden_dim; forward returns ``(out [T, H], router logits)``.
EVERY_TOKEN_MOES = {"transformers.models.llama4.modeling_llama4.Llama4TextMoe":
                    "transformers.models.llama4.modeling_llama4.Llama4Router"}


def route_every_token_moes(model: nn.Module) -> list["RoutedMoe"]:
    """Route every MoE layer of ``model`` of ``EVERY_TOKEN_MOES``, with its router of the class the table gives,
    whose experts are an ``every_token`` ``Sparse24Experts``; returns the routes.  Idempotent."""
    out = []
    for mod in model.modules():
        experts = getattr(mod, "experts", None)
        router = EVERY_TOKEN_MOES.get(class_name(mod))
        if router is None or class_name(getattr(mod, "router", None)) != router or \
                not isinstance(experts, Sparse24Experts) or not experts.every_token:
            continue
        route = route_of(mod)
        out.append(route if isinstance(route, RoutedMoe) else RoutedMoe(mod))
    return out


class RoutedMoe(EpilogueRoute):
    """The calls of an every-token MoE layer on its chosen experts alone (see the module docstring)."""

    HOW = "on its chosen experts alone"

    def what(self) -> str:
        return "its router's chosen experts' outputs on their scaled tokens, summed, plus its shared expert's"

    def compared(self, out):
        return out[0]

    def ready(self) -> bool:
        return False  # no GEMM of an epilogue for kp.warmup: the experts' grouped kernels are their own

    def call_fused(self, x: torch.Tensor, capturing: bool):
        mod = self.mod
        router = mod.router
        if capturing and not self.warmed:  # a capture may not build the routed calls' kernels
            return None
        if "forward" in router.__dict__ or router._forward_hooks or router._forward_pre_hooks:
            return None  # the route reads the router's weight itself, bypassing what wraps its calls (accelerate)
        hidden = x.reshape(-1, mod.hidden_dim)
        logits = nn.Linear.forward(router, hidden)  # the router's own first step
        top, index = torch.topk(logits, router.top_k, dim=1)  # its choice, from the same logits
        routed = mod.experts.routed(hidden, index, top, weigh="sigmoid inputs")
        out = mod.shared_expert(hidden)
        out.add_(routed)
        self.warmed = self.warmed or not capturing
        return out, logits
