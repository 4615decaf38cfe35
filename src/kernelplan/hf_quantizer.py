"""transformers' own ``from_pretrained`` for kernelplan 2:4 directories: a registered quantization method.

A directory kernelplan writes (``kp.hf.save_model``, or ``save_pretrained`` of a
sparsified model) records ``quantization_config = {"quant_method": "kernelplan",
...}`` in config.json.  Once ``kernelplan.hf.register_quantizer()`` has run in
the process (``kp.sparsify`` and ``kp.hf.load_model`` run it), transformers hands
such a directory to ``Sparse24Quantizer``:

* before the weights load, each layer the checkpoint holds 2:4 (``p.values`` and
  ``p.metadata``, read from the safetensors headers) becomes a ``Sparse24Linear``
  in the public format, on the meta device, so transformers' loader fills it by name;
* a MoE layer's experts, stored stacked (``p.gate_up_proj.values [E, M, K/2]``, as
  ``kp.hf.save_model`` writes them) or one layer an expert (``p.first.<e>.values``,
  a ``Sparse24Experts``' own state_dict, as ``save_pretrained`` writes it), get
  children holding them in place of their dense 3-D weights; checkpoint keys are
  renamed as transformers' loader renames them (``hf_names.py``); per-expert
  layers are checked and laid out into their projection's span as they load;
* after, each is checked (every group keeps 2 of 4) and laid out in the device
  layout (the experts as one ``Sparse24Experts``), and sibling layers are grouped
  (``kernelplan.nn.fuse_siblings``), as ``kp.hf.load_model`` does by default.

``model.dequantize()`` gives the dense layers (and experts modules) back, holding the pruned weights.

This module imports transformers at its top: only ``hf.register_quantizer`` imports it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .errors import InvalidProblem
from .nn.sparse24_linear import Sparse24Linear
from .hf import (LOAD_MODEL_HINT, QUANT_METHOD, checkpoint_format, dense_layer, experts_module, shards)
from .hf_names import EXPERT_LISTS, checkpoint_renamer, per_expert, stack_experts
from .sparse24.format import FORMAT_NAME, FORMAT_VERSION, Sparse24Weight, bad_words, check_shapes


class Sparse24QuantConfig(QuantizationConfigMixin):
    """config.json's record of a kernelplan 2:4 checkpoint (``quant_method="kernelplan"``).

    It describes files and has no loading options: transformers merges a ``quantization_config=`` given to
    ``from_pretrained`` into a checkpoint's own only for its built-in methods.
    """

    def __init__(self, format: str = FORMAT_NAME, format_version: int = FORMAT_VERSION,
                 quant_method: str = QUANT_METHOD, **unknown):
        if unknown:
            raise InvalidProblem(f"quantization_config holds {sorted(unknown)}, which kernelplan format version "
                                 f"{FORMAT_VERSION} does not write: the file was edited, or written by a newer "
                                 f"kernelplan (upgrade kernelplan)")
        self.quant_method, self.format, self.format_version = quant_method, format, format_version
        checkpoint_format({"quantization_config": self.to_dict()})  # an unknown format or version is refused here


def _loaded_placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``tensor``, marked as loaded: transformers' init functions skip it."""
    placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    placeholder._is_hf_initialized = True
    return placeholder


class _Loading(Sparse24Linear):
    """A 2:4 layer on the meta device while transformers loads it.  ``weight`` is there for models whose
    ``_init_weights`` reaches a child's weight (GPT-2's scales ``mlp.c_proj.weight``): a meta tensor marked as loaded,
    which transformers' init functions skip."""

    @property
    def weight(self) -> torch.Tensor:
        return _loaded_placeholder(torch.empty(self.out_features, self.in_features, dtype=self.values.dtype,
                                               device="meta"))


def _holder(shape: tuple, dtype: torch.dtype, bias: bool, holder: nn.Module | None = None) -> nn.Module:
    """A module (``holder``, or a new one) holding 2:4 ``values`` of ``shape`` (``[..., M, K/2]``) and their
    ``metadata`` on the meta device, and a ``bias [M]`` where asked, for transformers' loader to fill by name."""
    holder = nn.Module() if holder is None else holder
    holder.values = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
    holder.register_buffer("metadata", torch.empty(*shape[:-1], shape[-1] // 4, dtype=torch.int16, device="meta"))
    if bias:
        holder.bias = nn.Parameter(torch.empty(shape[-2], dtype=dtype, device="meta"))
    return holder


class _ExpertHolder(nn.Module):
    """One expert's 2:4 layer of a per-expert checkpoint (``_holder``'s tensors, on the meta device) while
    transformers' loader fills it by name.  Once its values and metadata have both come (the loader sets them as
    attributes), their shapes are checked, their words' check is started on the device (``bad``, read when the load
    ends), and they are converted into the expert's rows of its projection's span (``span_of``, shared by the
    projection's experts and made by the first to come, on its device) and dropped: the device holds one expert's
    checkpoint tensors at a time, not every expert's of the model until the load ends (docs/design/0047).  Where
    there is no span (the CPU; a shape that does not pack) the public tensors are kept, and laid out after."""

    def __init__(self, shape: tuple, dtype: torch.dtype, bias: bool, span_of, expert: int):
        super().__init__()
        _holder(shape, dtype, bias, self)
        self._span_of, self._expert = span_of, expert
        self.weight24 = self.bad = None  # the weight, and whether a word of it is not 2:4, once both have come

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("values", "metadata") and getattr(self, "_expert", None) is not None:
            self._lay_out()

    def _lay_out(self) -> None:
        values, metadata = self._parameters["values"], self._buffers["metadata"]
        if values.is_meta or metadata.is_meta:
            return
        with torch.no_grad():
            check_shapes(values, metadata)
            # Each word's check is read once the load ends (_build_experts): read here, the wait for it let the
            # loader's threads bring more of the checkpoint onto the device ahead of this thread.
            self.bad = bad_words(metadata).any()
            w24 = Sparse24Weight(values.detach(), metadata, _validate=False)
            w24 = self._span_of(w24.values).laid_out(self._expert, w24)
        self.weight24 = w24
        if w24.values is not values:  # laid out: the holder keeps the rows, not the checkpoint's tensors
            held = nn.Parameter(w24.values, requires_grad=False)
            held._is_hf_initialized = True  # transformers' init skips what the loader marked loaded
            self._parameters["values"], self._buffers["metadata"] = held, w24.metadata


class _Spans:
    """A projection's ``ExpertSpan``, made on the device and in the dtype of the first expert the loader fills."""

    def __init__(self, count: int, shape: tuple):
        self.count, self.shape, self.span = count, shape, None

    def __call__(self, like: torch.Tensor):
        from .nn.experts import ExpertSpan

        if self.span is None:
            self.span = ExpertSpan(self.count, self.shape, like)
        return self.span


class Sparse24Quantizer(HfQuantizer):
    """Loads a kernelplan 2:4 directory through ``from_pretrained``; see the module's docstring."""

    def __init__(self, quantization_config: Sparse24QuantConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if not self.pre_quantized:
            raise InvalidProblem("quantization_config=Sparse24QuantConfig(...) loads checkpoints that are 2:4 already, "
                                 "and this one's config.json does not say it is: load the dense model, then prune it "
                                 "with kp.sparsify(model) (with calibration=, docs/design/0023)")
        self.layers: list[str] = []  # what _process_model_before_weight_loading put on the meta device
        # prefix -> (its projections, held per expert, {projection: (meta weight, meta biases)})
        self.experts: dict[str, tuple[tuple[str, str], bool, dict]] = {}

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from .stream import headers

        if not checkpoint_files:  # transformers 4.x does not pass them; a local directory names its own shards
            where = getattr(getattr(model, "config", None), "name_or_path", None)
            if not where or not Path(where).is_dir():
                raise InvalidProblem(f"this transformers version does not hand a quantizer the checkpoint's files, "
                                     f"which name the 2:4 layers, and {where!r} is not a local directory to read "
                                     f"them from: download it and pass its path, load it with "
                                     f"kp.hf.load_model(path), or upgrade transformers (5.x passes them)")
            checkpoint_files = shards(where)
        rename = checkpoint_renamer(model)  # as transformers' loader will name the keys (0045)
        found = {rename(name): shape for path in checkpoint_files for name, (_, shape) in headers(path).items()}
        stacked: dict[str, dict[str, tuple]] = {}  # experts module -> {projection: [E, M, K/2]}
        by_expert: dict[str, dict[str, dict[int, tuple]]] = {}  # experts module -> {projection: {e: [M, K/2]}}
        for name, shape in found.items():
            prefix, _, leaf = name.rpartition(".")
            if leaf != "values":
                continue
            if len(shape) == 3:
                module, _, part = prefix.rpartition(".")
                stacked.setdefault(module, {})[part] = tuple(shape)
                continue
            expert = per_expert(model, prefix)
            if expert is not None:  # a Sparse24Experts' own state_dict: save_pretrained of a sparsified MoE model
                module, part, e = expert
                by_expert.setdefault(module, {}).setdefault(part, {})[e] = tuple(shape)
                continue
            self._hold_layer(model, prefix, tuple(shape))
        for module, parts in stacked.items():
            self._hold_experts(model, module, parts)
        for module, parts in by_expert.items():
            self._hold_experts(model, module, parts, per_expert=True)
        return model

    def _hold_layer(self, model, prefix: str, shape: tuple) -> None:
        """Put a 2:4 layer of the public format on the meta device where the checkpoint holds ``prefix.values``."""
        from .pruning.sparsify import is_conv1d

        layer, out_in = dense_layer(model, prefix)
        if len(shape) != 2 or out_in != (shape[0], 2 * shape[1]):
            there = type(layer).__name__ if layer is not None else "no module"
            raise InvalidProblem(f"{prefix} holds a 2:4 weight of {list(shape)} ([M, K/2]), but the model built from "
                                 f"config.json has {there} there: {LOAD_MODEL_HINT}")
        m, k = out_in
        with torch.device("meta"):
            values = torch.empty(m, k // 2, dtype=layer.weight.dtype)
            bias = torch.empty(m, dtype=layer.bias.dtype) if layer.bias is not None else None
            replacement = _Loading(values, torch.empty(m, k // 8, dtype=torch.int16), bias, layout="public",
                                   _validate=False)
        replacement.from_conv1d = is_conv1d(layer)
        parent = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
        setattr(parent, prefix.rpartition(".")[2], replacement)
        self.layers.append(prefix)

    def _hold_experts(self, model, prefix: str, parts: dict, per_expert: bool = False) -> None:
        """Where the checkpoint holds a MoE layer's experts 2:4, give the experts module children that the loader
        fills by name, in place of its dense 3-D weights:

        * stacked (``prefix.gate_up_proj.values [E, M, K/2]`` and ``.metadata``, as ``kp.hf.save_model`` writes
          them; ``parts`` is ``{projection: shape}``): a child of the projection's name holding both; the module's
          biases load as they are;
        * per expert (``prefix.first.<e>.values [M, K/2]`` and ``down.<e>``, a ``Sparse24Experts``' state_dict;
          ``parts`` is ``{projection: {e: shape}}``): a list of children ``first`` / ``down``, one an expert, each
          holding its values, metadata and, where the module has biases, its bias.
        """
        from .nn.experts import expert_weight, parts_of

        module = experts_module(model, prefix)
        names = parts_of(module)
        if set(parts) != set(names):
            raise InvalidProblem(f"{prefix}: the checkpoint holds {sorted(parts)} 2:4, and the experts module has "
                                 f"{list(names)}; a checkpoint holds both projections of an experts module 2:4, or "
                                 f"neither")
        dense_parts = {}  # projection -> its meta weight and biases, put back for from_experts' checks
        for part, found in parts.items():
            dense = getattr(module, part)
            want = (dense.shape[0], *expert_weight(module, part, 0).shape)
            shapes = stack_experts(f"{prefix}.{part}", found, want[0]) if per_expert else [found[1:]] * found[0]
            if len(shapes) != want[0] or any(s != (want[1], want[2] // 2) for s in shapes):
                got = " or ".join(str(list(s)) for s in sorted(set(shapes)))
                raise InvalidProblem(f"{prefix}.{part}: the checkpoint holds {len(shapes)} 2:4 experts of {got} "
                                     f"([M, K/2]), and the model built from config.json has {want[0]} experts of "
                                     f"{list(want[1:])} ([out, in]) there")
            bias = module._parameters.pop(f"{part}_bias", None) if per_expert else None  # else it loads as it is
            dense_parts[part] = module._parameters.pop(part), bias
            if per_expert:
                spans = _Spans(len(shapes), want[1:])
                holder = nn.ModuleList(_ExpertHolder(shapes[0], dense.dtype, bias is not None, spans, e)
                                       for e in range(len(shapes)))
                module.add_module(EXPERT_LISTS[names.index(part)], holder)
                # transformers' init runs over every module after loading, and reads the experts' weights by name
                # (Mixtral's init.normal_(module.gate_up_proj)): meta tensors marked as loaded, which it skips.
                for name, tensor in ((part, dense), (f"{part}_bias", bias)):
                    if tensor is not None:
                        module.__dict__[name] = _loaded_placeholder(tensor)
            else:
                holder = _holder((want[0], *shapes[0]), dense.dtype, False)
                holder._is_hf_initialized = True  # read by that init as module.<part>: skipped
                module.add_module(part, holder)
        self.experts[prefix] = (names, per_expert, dense_parts)

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .nn.siblings import fuse_siblings

        for prefix in self.layers:
            layer = model.get_submodule(prefix)
            if layer.values.is_meta or layer.metadata.is_meta:
                raise InvalidProblem(f"{prefix}: the checkpoint names its 2:4 values, but transformers left the "
                                     f"layer on the meta device: a device_map that offloads it to disk (give more "
                                     f"max_memory), or a loader that skipped it ({LOAD_MODEL_HINT})")
            # In place: the module object stays the one transformers placed (accelerate's hooks under a device_map
            # are on it or its parents).
            with torch.no_grad():  # a corrupt group is refused by Sparse24Weight
                layer.hold(Sparse24Weight(layer.values.detach(), layer.metadata), "auto", layer.values.requires_grad)
            layer.__class__ = Sparse24Linear
        for prefix in self.experts:
            self._build_experts(model, prefix)
        fuse_siblings(model)
        return model

    def _build_experts(self, model, prefix: str) -> None:
        """The loaded 2:4 weights of an experts module, checked, as a ``Sparse24Experts`` in its place."""
        from .nn.experts import Sparse24Experts

        module = model.get_submodule(prefix)
        names, per_expert, dense_parts = self.experts[prefix]
        pruned = {}
        for i, part in enumerate(names):
            holder = module._modules.pop(EXPERT_LISTS[i] if per_expert else part)
            held = list(holder) if per_expert else [holder]
            if any(h.values.is_meta or h.metadata.is_meta for h in held):
                raise InvalidProblem(f"{prefix}.{part}: the checkpoint names its 2:4 values, but transformers left "
                                     f"them on the meta device ({LOAD_MODEL_HINT})")
            with torch.no_grad():
                if per_expert:  # checked as each came (_ExpertHolder)
                    bad = torch.stack([h.bad.to(held[0].bad.device) for h in held])
                    if bad.any():
                        raise InvalidProblem(
                            f"{prefix}.{part}, expert {int(bad.nonzero()[0])}: its metadata holds a word that is not "
                            f"2:4 (each byte must hold pos0 in bits 0-1 and pos1 > pos0 in bits 2-3, bits 4-7 "
                            f"clear); the checkpoint is corrupt: save it again from the model it came from")
                    pruned[part] = [h.weight24 for h in held]
                    for h in held:
                        h.weight24 = None
                    if dense_parts[part][1] is not None:
                        module._parameters[f"{part}_bias"] = nn.Parameter(
                            torch.stack([h.bias.detach() for h in held]), requires_grad=False)
                else:  # each expert's words checked here
                    pruned[part] = [Sparse24Weight(v, m) for v, m in zip(holder.values.detach(), holder.metadata)]
            for name in (part, f"{part}_bias"):
                module.__dict__.pop(name, None)
            module._parameters[part] = dense_parts[part][0]
        del holder, held  # pruned alone holds the loaded tensors now, and from_experts frees them as it lays out
        parent = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
        setattr(parent, prefix.rpartition(".")[2], Sparse24Experts.from_experts(module, pruned, consume=True))

    def _dequantize(self, model, dtype=None):
        """``model.dequantize()``: each 2:4 layer back to the dense module it replaced (``nn.Linear``, or GPT-2's
        ``Conv1D``), and each ``Sparse24Experts`` to the transformers experts module it was built from, holding the
        pruned weights, so the model is a plain transformers model (its ``save_pretrained`` a dense directory any
        loader reads).  The routes of MLPs whose layers are replaced are detached."""
        from transformers.pytorch_utils import Conv1D

        from .nn.experts import Sparse24Experts
        from .nn.routes import route_of

        # Every experts module converted before any is put back: a refusal leaves the model as it was.
        experts = {n: m.to_dense_module() for n, m in model.named_modules() if isinstance(m, Sparse24Experts)}
        if dtype is not None:
            experts = {n: m.to(dtype) for n, m in experts.items()}
        for name, dense in experts.items():
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], dense)
        for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, Sparse24Linear)]:
            with torch.no_grad():
                weight = layer.to_dense().to(dtype or layer.values.dtype)
                bias = layer.bias.detach().to(weight.dtype) if layer.bias is not None else None
                if layer.from_conv1d:
                    dense = Conv1D(layer.out_features, layer.in_features).to(weight.device, weight.dtype)
                    dense.weight.copy_(weight.t())
                else:
                    dense = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None,
                                      device=weight.device, dtype=weight.dtype)
                    dense.weight.copy_(weight)
                if bias is not None:
                    dense.bias.copy_(bias)
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], dense)
        for module in model.modules():
            route = route_of(module)
            if route is not None and route.children_replaced():
                route.detach()
        return model

    def validate_environment(self, device_map=None, **kwargs):
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        if "disk" in places:
            raise InvalidProblem("device_map places modules on 'disk': kernelplan's 2:4 layers are converted to the "
                                 "device layout once loaded, which offloaded weights are not; give a device_map "
                                 "of GPUs (and 'cpu'), or more max_memory")

    def is_serializable(self, *args, **kwargs) -> bool:
        return True  # the 2:4 layers' state_dict is the public format, which this quantizer reads

    @property
    def is_trainable(self) -> bool:
        return True  # the kept values are Parameters; the masks stay fixed

    @property
    def is_qat_trainable(self) -> bool:
        # transformers' Trainer refuses to fine-tune a quantized model without adapters unless this holds; a 2:4
        # model trains its kept values in place (its masks fixed), as a model kp.sparsify made in memory does.
        return True

    @property
    def is_compileable(self) -> bool:
        return True
