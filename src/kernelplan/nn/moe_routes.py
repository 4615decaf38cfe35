"""A MoE layer whose experts run every token (Llama-4's) sent through the experts its router chose alone.

``Llama4TextMoe`` repeats its T tokens once an expert, scales each copy by the router's score for that expert (zero
for an expert the token did not choose: the sigmoid of -inf) and runs all E x T rows through its experts module,
then sums each token's E outputs (``nn/experts.py``'s ``EVERY_TOKEN``).  A row of zeros gives zeros (no bias), so
the sum is that of the chosen experts' outputs on their scaled copies: the route computes those alone, as the top-k
experts modules do (``Sparse24Experts.routed``), each copy a pair of its own.  A decode step then reads the chosen
experts' weights, not every expert's, and a prefill does 1/E of the module's work.

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

# The MoE layers the route computes, by class name: children router (returning ``(scores [T, E], logits)``),
# experts (an ``EVERY_TOKEN`` module) and shared_expert, attributes top_k and hidden_dim; forward returns
# ``(out [T, H], router logits)``.
EVERY_TOKEN_MOES = ("transformers.models.llama4.modeling_llama4.Llama4TextMoe",)


def route_every_token_moes(model: nn.Module) -> list["RoutedMoe"]:
    """Route every MoE layer of ``model`` of ``EVERY_TOKEN_MOES`` whose experts are an ``every_token``
    ``Sparse24Experts``; returns the routes.  Idempotent."""
    out = []
    for mod in model.modules():
        experts = getattr(mod, "experts", None)
        if class_name(mod) not in EVERY_TOKEN_MOES or not isinstance(experts, Sparse24Experts) or \
                not experts.every_token:
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
        if capturing and not self.warmed:  # a capture may not build the routed calls' kernels
            return None
        hidden = x.reshape(-1, mod.hidden_dim)
        scores, logits = mod.router(hidden)
        # The router's own choice: the same top-k of the same logits (its scores are zero elsewhere).
        index = torch.topk(logits, mod.top_k, dim=1).indices
        scale = scores.gather(1, index)
        pairs = (hidden[:, None, :] * scale[..., None]).reshape(-1, hidden.shape[1])  # Llama-4's product, by pair
        ones = torch.ones(pairs.shape[0], 1, dtype=pairs.dtype, device=pairs.device)
        routed = mod.experts.routed(pairs, index.reshape(-1, 1), ones)
        out = mod.shared_expert(hidden)
        # Llama-4's top_k is 1: each token's one pair is its row, with no sum of one term (a launch and a buffer).
        out.add_(routed if mod.top_k == 1 else routed.view(-1, mod.top_k, routed.shape[-1]).sum(dim=1))
        self.warmed = self.warmed or not capturing
        return out, logits
