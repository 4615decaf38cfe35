"""``evaluate``: a language model's perplexity on a stream of token ids."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InvalidProblem

# Logits one forward may return, in elements: the default batch of windows is cut to stay under it.  8 windows of
# 2048 tokens over Llama-3's 128256-token vocabulary are 2.1G logits, 4.2 GB in bf16; on the CPU, 8 windows of 2048
# tokens of SmolLM2-135M (49152) took evaluate's peak RSS to 10 GiB when the whole batch's loss was taken at once
# (docs/design/0023).
LOGITS_BUDGET = 1 << 28
# Positions whose logits are upcast to float32 together for the loss: never a copy of a whole batch's logits.
LOSS_ROWS = 1024


def _logits(out) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, torch.Tensor):
        raise InvalidProblem(f"the model returned a {type(out).__name__} with no logits; evaluate needs a language "
                             f"model whose forward returns logits [batch, tokens, vocab] (or an object with .logits)")
    return logits


def evaluate(model: nn.Module, token_ids: torch.Tensor, seq_len: int | None = None,
             batch_size: int | None = None) -> float:
    """Perplexity, ``exp`` of the mean next-token negative log-likelihood.

    ``token_ids`` is one stream ``[T]``, cut into windows of ``seq_len`` tokens
    (default: the model config's ``max_position_embeddings``, at most 2048), or
    ready windows ``[N, S]``.  Windows do not overlap; every token after the
    first of its window is predicted once.  Runs ``batch_size`` windows at a
    time (default: up to 8, as many as keep a forward's logits under
    ``LOGITS_BUDGET`` elements, where the config gives ``vocab_size``), in the
    model's device, without gradients; the loss is taken ``LOSS_ROWS``
    positions at a time.
    """
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InvalidProblem(f"batch_size is {batch_size!r}; pass a whole number of windows >= 1, or None for the "
                             f"default")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int32, torch.int64) \
            or token_ids.dim() not in (1, 2):
        raise InvalidProblem(f"token_ids is {getattr(token_ids, 'dtype', type(token_ids).__name__)} of shape "
                             f"{tuple(getattr(token_ids, 'shape', ()))}; pass int64 token ids, a stream [T] or windows [N, S]")
    if token_ids.dim() == 1:
        if seq_len is None:
            seq_len = min(int(getattr(getattr(model, "config", None), "max_position_embeddings", 2048) or 2048), 2048)
        if seq_len < 2:
            raise InvalidProblem(f"seq_len is {seq_len}; a window predicts its tokens after the first: use >= 2")
        full = token_ids.numel() // seq_len * seq_len
        windows = list(token_ids[:full].view(-1, seq_len))
        if token_ids.numel() - full >= 2:
            windows.append(token_ids[full:])
    else:
        windows = list(token_ids)
    if not windows or windows[0].numel() < 2:
        raise InvalidProblem(f"token_ids holds {token_ids.numel()} tokens; perplexity needs windows of >= 2 tokens")
    if batch_size is None:
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        batch_size = max(1, min(8, LOGITS_BUDGET // (windows[0].numel() * vocab))) if vocab else 8
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    nll, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in range(0, len(windows), batch_size):
                for group in _same_length(windows[b:b + batch_size]):
                    ids = torch.stack(group).to(device)
                    logits = _logits(model(ids))
                    nll += sum(_window_nll(logits[i], ids[i]) for i in range(len(group)))
                    count += ids[:, 1:].numel()
    finally:
        model.train(was_training)
    return math.exp(nll / count)


def _window_nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """The summed negative log-likelihood of ``ids[1:]`` under one window's ``logits`` [S, vocab], ``LOSS_ROWS``
    positions at a time (slices of the logits: no copy of them but each slice's float32)."""
    total = 0.0
    for s in range(0, ids.numel() - 1, LOSS_ROWS):
        e = min(s + LOSS_ROWS, ids.numel() - 1)
        total += float(torch.nn.functional.cross_entropy(logits[s:e].float(), ids[s + 1:e + 1], reduction="sum"))
    return total


def _same_length(windows: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        groups.setdefault(w.numel(), []).append(w)
    return list(groups.values())
