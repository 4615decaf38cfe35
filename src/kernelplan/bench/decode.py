"""Greedy decode one token per call on a static KV cache, eagerly or replayed as a CUDA graph.

``generate()`` spends milliseconds of Python per token on a small model, so
what it measures on a GPU is the host, for dense and sparse alike.  A decode
step captured once in a CUDA graph and replayed measures what the weights
cost: the way servers (vLLM, torch.compile's "reduce-overhead") run decode.
The step reads and writes only tensors at fixed addresses: the token, its
position and the cache all advance in place, inside the graph.
"""

from __future__ import annotations

import inspect
import time

import torch

from ..timing import capture


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers, each storage once, plus the 2:4 layouts its layers and their
    sibling groups built."""
    from ..nn import Sparse24Linear, siblings_of
    from ..sparse24 import Sparse24Weight

    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    groups = {}
    for mod in model.modules():
        if isinstance(mod, Sparse24Linear):
            total += sum(mod.weight24.derived_bytes().values())
            siblings = siblings_of(mod)
            if siblings is not None:
                groups.update((id(g), g) for g in siblings.groups or () if g.fused is not None)
    for g in groups.values():  # a group's buffers are its members' storage; what its calls derived is its own
        total += sum(Sparse24Weight(g.fused[0], g.fused[1], _validate=False).derived_bytes().values())
    return total


def static_cache(model, batch: int, max_len: int):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw = dict(config=model.config, max_cache_len=max_len)
    if "max_batch_size" in params:  # transformers 4.x sizes the cache up front
        kw.update(max_batch_size=batch, device=model.device, dtype=model.dtype)
    return StaticCache(**kw)


class DecodeStep:
    """``step()`` appends one greedy token to each row: ``self.tok`` and ``self.pos`` advance in place."""

    def __init__(self, model, prompt: torch.Tensor, max_len: int):
        batch, length = prompt.shape
        self.model, self.cache = model, static_cache(model, batch, max_len)
        # transformers 4.x locates the cache write by cache_position; 5.x by the cache's own counter.
        self.legacy = "cache_position" in inspect.signature(model.forward).parameters
        self.pos = torch.arange(length, device=prompt.device)
        logits = self._forward(prompt)  # the prefill
        self.tok = logits[:, -1].argmax(-1, keepdim=True)
        self.pos = torch.full((1,), length, device=prompt.device, dtype=torch.long)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        kw = dict(position_ids=self.pos.view(1, -1).expand(ids.shape[0], -1), past_key_values=self.cache,
                  use_cache=True)
        if self.legacy:
            kw["cache_position"] = self.pos
        return self.model(input_ids=ids, **kw).logits

    def __call__(self) -> torch.Tensor:
        logits = self._forward(self.tok)
        self.tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)
        return logits

    def counters(self) -> list[tuple[object, str, int]]:
        """The cache's positions held as Python ints, ``(layer, attribute, value)``: transformers 5's sliding-window
        layers (Llama-4's chunked attention, Gemma's local layers) count their tokens in ``cumulative_length_int``.
        An eager step advances them; a graph's capture advances them without running the step, and its replays read
        the value the capture saw."""
        return [(layer, name, value) for layer in getattr(self.cache, "layers", ())
                for name, value in vars(layer).items() if type(value) is int and name.startswith("cumulative")]

    def state(self) -> list[torch.Tensor]:
        """Every tensor a step reads and writes: the token, its position, the cache."""
        tensors = [self.tok, self.pos]
        for layer in getattr(self.cache, "layers", ()):  # transformers 5.x
            tensors += [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        for name in ("key_cache", "value_cache"):  # transformers 4.x
            tensors += list(getattr(self.cache, name, ()))
        return tensors


class Graphed:
    """``fn()`` (returning a tensor) captured once in a CUDA graph, after a warm-up on a side stream."""

    def __init__(self, fn, warmup: int = 3):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles kernels and tunes 2:4 dispatch outside the capture
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.fn = fn
        self.graph = torch.cuda.CUDAGraph()
        held = self._host_state()
        with capture(self.graph):
            self.out = fn()
        self._set_host_state(held)

    def _host_state(self) -> list:
        """What of ``fn``'s state lives on the host: the capture records ``fn`` without running it, so it is set back
        after (``_set_host_state``)."""
        return []

    def _set_host_state(self, held: list) -> None:
        pass

    def check(self) -> float:
        """max |replay - eager| / max |eager| of one call (for a ``fn`` whose state it does not advance)."""
        eager = self.fn().float()
        self.graph.replay()
        return float((self.out.float() - eager).abs().max() / eager.abs().max())

    def replay_seconds(self, replays: int) -> float:
        """Wall time per replay of ``replays`` back-to-back replays."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            self.graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / replays


class GraphedDecode(Graphed):
    """A ``DecodeStep`` captured once; ``check()`` compares a replay with the eager step from the same state."""

    def __init__(self, step: DecodeStep, warmup: int = 3):
        self.step = step
        super().__init__(step, warmup)

    def _host_state(self) -> list:
        # The cache's Python counters: the capture advances them and none of its tensors.  Set back, they say where
        # the tensors are, and an eager step from there is the step the graph holds (a sliding-window layer's replays
        # write the slot the capture saw, as any graph of such a cache does).
        return self.step.counters()

    def _set_host_state(self, held: list) -> None:
        for layer, name, value in held:
            setattr(layer, name, value)

    def check(self) -> float:
        saved = [t.clone() for t in self.step.state()]
        counters = self._host_state()
        eager = self.step().float()
        for t, s in zip(self.step.state(), saved):
            t.copy_(s)
        self._set_host_state(counters)
        self.graph.replay()
        return float((self.out.float() - eager).abs().max() / eager.abs().max())
