"""Sequential calibration: a model's blocks are pruned one after another, each on the outputs of the pruned ones before.

The blocks are found by one rule (:func:`find_blocks`): the first
``nn.ModuleList``, in module order, whose every entry holds an ``nn.Linear``.
In a Hugging Face decoder model that is its decoder layers
(``model.model.layers`` of a Llama, Qwen, Mistral, Mixtral, Gemma or Phi;
``transformer.h`` of GPT-style models); ``blocks=`` overrides it.

Each block's arguments are captured once, as the model calls it (the model
runs to its last block), then for each block: its linear layers' input
statistics are gathered on a dense pass, its layers are pruned, and a second
pass of the pruned block gives the next block's hidden states, passed with that
block's own other arguments.  Only one block's activations are held at a time,
on the model's device.

The Wanda and SparseGPT reference code captures the first block's arguments
and passes them to every block.  That holds where every block takes the same
mask and positions (their OPT and LLaMA-1), not where blocks take arguments of
their own: Gemma-2/3's, Cohere-2's and gpt-oss's sliding-window layers their
own masks (and Gemma-3's its own rotary tables), hybrid models' attention and
Mamba layers theirs, Zamba2's hybrid layers their index (a KeyError there).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import InvalidProblem


class _Reached(Exception):
    """Raised by the hook on the last block: the rest of the model need not run."""


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: its first ``nn.ModuleList`` whose every entry holds an ``nn.Linear``; in a model
    with a language model beside other towers (a config with a ``text_config``: LLaVA, Qwen2-VL, Gemma-3, Llama-4 ...),
    the language model's (``get_decoder()``).  Its vision tower's layers come first in module order, and text-only
    calibration never reaches them; the language model holds most of the weights."""
    scope, prefix = model, ""
    decoder = model.get_decoder() if getattr(getattr(model, "config", None), "text_config", None) is not None and \
        callable(getattr(model, "get_decoder", None)) else None
    if isinstance(decoder, nn.Module) and decoder is not model:
        prefix = next((f"{name}." for name, mod in model.named_modules() if mod is decoder), "")
        scope = decoder if prefix else model
    for name, mod in scope.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(
            any(isinstance(m, nn.Linear) for m in block.modules()) for block in mod
        ):
            return prefix + name, mod
    raise InvalidProblem(
        f"{type(model).__name__} has no nn.ModuleList of blocks holding nn.Linear layers, which calibration prunes "
        f"one after another: pass blocks= (the list of the model's repeated layers, e.g. model.model.layers)"
    )


def resolve_blocks(model: nn.Module, blocks) -> tuple[str, list[nn.Module]]:
    """``blocks=``: None (the rule), a dotted submodule name, or a sequence of the model's submodules."""
    if blocks is None:
        name, found = find_blocks(model)
        return name, list(found)
    if isinstance(blocks, str):
        try:
            found = model.get_submodule(blocks)
        except AttributeError as e:
            raise InvalidProblem(f"blocks={blocks!r} names no submodule of {type(model).__name__} ({e}); pass the "
                                 f"dotted name of its list of layers, e.g. 'model.layers'") from e
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise InvalidProblem(f"blocks={blocks!r} is a {type(found).__name__}; name an nn.ModuleList of layers")
        return blocks, list(found)
    members = {id(m): n for n, m in model.named_modules()}
    blocks = list(blocks)
    strangers = [i for i, b in enumerate(blocks) if id(b) not in members]
    if not blocks or strangers:
        raise InvalidProblem(f"blocks has {len(blocks)} entries, {len(strangers)} of them not submodules of the "
                             f"model; pass the model's own layers, in the order they run")
    return "blocks", blocks


def batches(calibration, batch_size: int) -> list:
    """Calibration data as model inputs: ``[N, S]`` token ids split into batches of rows, or a list given as is."""
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() != 2 or calibration.dtype not in (torch.int32, torch.int64) or not calibration.numel():
            raise InvalidProblem(
                f"calibration has shape {tuple(calibration.shape)} and dtype {calibration.dtype}; pass token ids "
                f"[N sequences, S tokens] (int64), or a list of model inputs (tensors or dicts of keyword arguments)"
            )
        if batch_size < 1:
            raise InvalidProblem(f"batch_size is {batch_size}; it is the number of sequences per forward: use >= 1")
        return list(calibration.split(batch_size))
    if isinstance(calibration, Iterable) and not isinstance(calibration, (str, bytes, dict)):
        items = list(calibration)
        if items and all(isinstance(b, (torch.Tensor, dict)) for b in items):
            return items
    raise InvalidProblem(f"calibration is a {type(calibration).__name__}; pass token ids [N, S] or a non-empty list "
                         f"of model inputs (tensors, or dicts of keyword arguments)")


def _call(model: nn.Module, batch) -> object:
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    device = next((p.device for p in model.parameters()), None)
    if isinstance(batch, dict):
        return model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, **extra)
    return model(batch.to(device), **extra)


def capture_inputs(model: nn.Module, blocks: list[nn.Module], data: list) -> list[list[tuple[tuple, dict]]]:
    """Each block's ``(args, kwargs)`` as the model calls it, one per calibration batch: ``calls[block][batch]``.  The
    first block's whole; the others' without their hidden states (``_without_hidden``), which the pruned blocks before
    them give.  A block the model calls twice in a batch (one module at several places) keeps its first call."""
    calls: list[list] = [[] for _ in blocks]
    at = {id(block): i for i, block in enumerate(blocks)}
    batch = 0

    def hook(module, args, kwargs):
        i = at[id(module)]
        if len(calls[i]) == batch:
            calls[i].append((args, kwargs) if i == 0 else _without_hidden(args, kwargs))
        if all(len(c) > batch for c in calls):
            raise _Reached

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    try:
        for batch, inputs in enumerate(data):
            try:
                _call(model, inputs)
            except _Reached:
                continue
            missed = [i for i, c in enumerate(calls) if len(c) == batch]
            raise InvalidProblem(
                f"the model ran to the end without calling its block{'s' * (len(missed) > 1)} "
                f"{', '.join(map(str, missed[:8]))} (of {len(blocks)}); pass blocks= naming the layers its forward "
                f"runs, in order")
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _without_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's call with its hidden states left out (None in their place), for ``_with_hidden`` to fill."""
    if args:
        return (None, *args[1:]), kwargs
    return args, {k: v for k, v in kwargs.items() if k != "hidden_states"}


def _hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _with_hidden(call: tuple[tuple, dict], hidden: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def run_blocks(blocks: list[nn.Module], calls: list[list[tuple[tuple, dict]]],
               prune_block: Callable[[int, nn.Module, Callable[[], None]], None], progress,
               timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """For each block: ``prune_block(i, block, dense_pass)``, then the pruned block's outputs are the next block's
    hidden states, beside its own other arguments (``capture_inputs``)."""
    inputs, calls[0] = calls[0], []  # one block's activations held at a time
    for i, block in enumerate(progress(blocks)):

        def dense_pass(block=block):
            for args, kwargs in inputs:
                block(*args, **kwargs)

        prune_block(i, block, dense_pass)
        if i + 1 < len(blocks):
            with timed():
                inputs = [_with_hidden(after, _hidden(block(*call[0], **call[1])))
                          for call, after in zip(inputs, calls[i + 1])]
            calls[i + 1] = []  # the next block's calls are in inputs now, with its hidden states


def model_pass(model: nn.Module, data: list) -> None:
    for batch in data:
        _call(model, batch)
