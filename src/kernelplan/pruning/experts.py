"""Wanda and SparseGPT for a MoE layer's experts: each expert pruned on the calibration tokens routed to it.

A transformers experts module (``nn/experts.py``) takes ``(hidden_states [T, H], top_k_index [T, k], ...)``.  A
forward pre-hook on it reads, for each expert ``e``, the rows of ``hidden_states`` that ``top_k_index`` sends to
``e``: the inputs of its first projection (gate/up).  An ``every_token`` module (Llama-4's) takes each expert's block
of rows in turn, each row a token scaled by the router's score: the rows of ``e``'s block that are not zero.  The
inputs of its down projection are those rows through the expert's own dense first projection and the module's own
gating (``_apply_gate``, or the activation where there is no gate), computed in the hook: the module's forward never
exposes them.  As for the linear layers
(``calibrate.py``), the statistics come from a pass of the block before its experts are pruned.

SparseGPT holds ``X^T X`` for both projections of every expert: ``E (H^2 + I^2)`` fp32 values, 7 GiB for a
Mixtral-8x7B layer and 56 GiB for DeepSeek-V3's.  So the experts are gathered in chunks of at most
``STATS_BYTES`` of statistics, one calibration pass of the block per chunk.

An expert that no calibration token reached has no statistics to score it by.  It is pruned by magnitude, and the
report's ``uncalibrated`` names it: calibration data that reaches it (more tokens) calibrates it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.experts import ExpertSpan, expert_bias, expert_weight, parts_of, runs_every_token, source_activation
from ..sparse24.format import Sparse24Weight
from . import methods

STATS_BYTES = 4 << 30  # the statistics held at once: one chunk of experts


class _Gatherer:
    """The input statistics of experts ``ids`` of ``module``, as a forward pre-hook on it gathers them."""

    def __init__(self, module: nn.Module, ids: range, full: bool, dtype: torch.dtype):
        self.module, self.ids = module, ids
        self.first_name, self.down_name = parts_of(module)
        self.activate = source_activation(module)
        self.bias = expert_bias(module, self.first_name)
        self.every_token, self.count = runs_every_token(module), getattr(module, self.first_name).shape[0]
        device = getattr(module, self.first_name).device
        k_first = expert_weight(module, self.first_name, 0).shape[1]
        k_down = expert_weight(module, self.down_name, 0).shape[1]
        self.first = {e: methods.InputStats(k_first, device, full, dtype) for e in ids}
        self.down = {e: methods.InputStats(k_down, device, full, dtype) for e in ids}

    def __call__(self, module, args, kwargs) -> None:
        bias = self.bias
        for e in self.ids:
            x = self._routed(args, kwargs, e)
            if not x.shape[0]:
                continue
            self.first[e].add(x)
            h = F.linear(x, expert_weight(module, self.first_name, e).to(x.dtype),
                         bias[e].to(x.dtype) if bias is not None else None)
            self.down[e].add(self.activate(h))

    def _routed(self, args, kwargs, e: int) -> torch.Tensor:
        """The rows of the call's hidden states that go to expert ``e``: those its routing sends there or, for an
        ``every_token`` module, the rows of its block that are not zero (its MoE scales a token's copy for an expert
        it did not choose by zero: Llama-4's sigmoid of -inf)."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.every_token:
            x = hidden.reshape(self.count, -1, hidden.shape[-1])[e]
            return x[(x != 0).any(dim=-1)]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        return hidden.index_select(0, (index == e).any(dim=-1).nonzero().squeeze(1))


def _bytes_per_expert(module: nn.Module, full: bool, dtype: torch.dtype) -> int:
    ks = [expert_weight(module, name, 0).shape[1] for name in parts_of(module)]
    return sum(k * k if full else k for k in ks) * dtype.itemsize


def _gather(run: Callable[[], None], module: nn.Module, gatherer: _Gatherer) -> None:
    handle = module.register_forward_pre_hook(gatherer, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()


def calibrate_experts(module: nn.Module, method: str, run: Callable[[], None], measure: bool, blocksize: int,
                      damp: float) -> tuple[dict[str, list[Sparse24Weight]], list[int], dict[str, float]]:
    """Each expert's projections pruned by ``method`` (one of ``methods.METHODS``) on the inputs ``run()`` routes to
    it, compressed: ``({part: [weight of each expert]}, the experts no token reached, {part: mean relative output
    error over the calibrated experts})``, the errors only with ``measure``."""
    full = method == "sparsegpt" or measure
    count = getattr(module, parts_of(module)[0]).shape[0]
    dtype = torch.float64 if getattr(module, parts_of(module)[0]).dtype == torch.float64 else torch.float32
    chunk = max(1, STATS_BYTES // _bytes_per_expert(module, full, dtype))
    out: dict[str, list[Sparse24Weight]] = {name: [] for name in parts_of(module)}
    # Each expert compressed straight into its rows of the projection's span, which Sparse24Experts then holds as
    # it is: no expert's own device layout beside it (docs/design/0046).
    spans = {name: ExpertSpan.of(module, name) for name in parts_of(module)}
    errors: dict[str, list[float]] = {name: [] for name in parts_of(module)}
    unreached = []
    for start in range(0, count, chunk):
        gatherer = _Gatherer(module, range(start, min(count, start + chunk)), full, dtype)
        _gather(run, module, gatherer)
        for e in gatherer.ids:
            reached = gatherer.first[e].tokens > 0
            if not reached:
                unreached.append(e)
            for name, stats in zip(parts_of(module), (gatherer.first[e], gatherer.down[e])):
                w = expert_weight(module, name, e).detach()
                if not reached:
                    out[name].append(spans[name].compressed(e, w, prune=True))
                    continue
                pruned = methods.prune(method, w, stats, blocksize, damp)
                if measure:
                    errors[name].append(methods.relative_error(w, pruned, stats))
                out[name].append(spans[name].compressed(e, pruned, prune=False))
        del gatherer
    means = {name: sum(v) / len(v) for name, v in errors.items() if v}
    return out, unreached, means
