"""Hugging Face model directories: read and write 2:4 checkpoints in kernelplan's format and the ones in the wild.

A directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-*.safetensors`` named by ``model.safetensors.index.json``.  A 2:4 layer
``p`` is stored as one of:

* ``kernelplan``: ``p.values [M, K/2]`` and ``p.metadata [M, K/8]`` (the public
  format, ``kernelplan/sparse24/format.py``); a MoE layer's experts, stacked as
  transformers holds them (``p`` is ``...experts.gate_up_proj``, ``up_proj`` or
  ``down_proj``), ``p.values [E, M, K/2]`` and ``p.metadata [E, M, K/8]``: each
  expert's projection as a linear layer's ``[out, in]``, whatever the module's
  ``is_transposed``, with their biases under the module's own names; or one layer an
  expert, as a ``Sparse24Experts`` holds them (``<experts>.first.<e>`` and
  ``down.<e>``: a sparsified model's ``save_pretrained``, ``hf_names.py``);
* ``sparse-24-bitmask`` (compressed-tensors, as llm-compressor wrote it):
  ``p.compressed [M, K/2]`` (byte-identical to ``values``), ``p.bitmask``
  (uint8 ``[M, K/8]``, the keep-mask packed little-endian along each row) and
  ``p.shape`` (``[[M], [K]]``), with config.json's
  ``quantization_config.sparsity_config.format == "sparse-24-bitmask"``;
* ``dense``: ``p.weight`` with two zeros in every group of 4 (llm-compressor's
  dense save of a 2:4 model, ``sparsity_config.format == "dense"`` and
  ``sparsity_structure == "2:4"``).  Reading refuses a targeted layer that is not 2:4.

Reading and writing go tensor by tensor: a shard is opened lazily and one
tensor is materialized at a time, on the target device.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ._checks import warn
from .errors import InvalidProblem
from .hf_names import checkpoint_renamer, per_expert, rename_prefix, stack_experts
from .sparse24.format import FORMAT_NAME, FORMAT_VERSION, Sparse24Weight, compress, is_sparse24

FORMATS = ("kernelplan", "sparse-24-bitmask", "dense")
INDEX = "model.safetensors.index.json"
# config.json's quantization_config.quant_method for kernelplan's format: the name transformers' from_pretrained looks
# up among registered quantizers (hf_quantizer.py, register_quantizer).
QUANT_METHOD = "kernelplan"
LOAD_MODEL_HINT = "load the directory with kp.hf.load_model(path), which builds every layer kernelplan writes"


def _byte(nibble: int) -> int:
    kept = [i for i in range(4) if nibble >> i & 1]
    return kept[0] | (kept[1] << 2) if len(kept) == 2 else -1


# A group's 4 keep-bits (a nibble of the packed bitmask) -> its metadata byte (pos0 | pos1 << 2); -1: not 2 of 4.
_NIBBLE_TO_BYTE = [_byte(n) for n in range(16)]


def bitmask_to_metadata(bitmask: torch.Tensor, shape: tuple[int, int], name: str = "bitmask") -> torch.Tensor:
    """compressed-tensors' packed keep-mask ``[M, K/8]`` uint8 -> kernelplan metadata ``[M, K/8]`` int16.

    Elementwise on the ``[M, K/8]`` bytes (a 16-entry table per nibble), so a layer
    converts on the GPU with no temporary larger than its metadata.
    """
    m, k = shape
    if bitmask.dtype != torch.uint8 or tuple(bitmask.shape) != (m, k // 8) or k % 8:
        raise InvalidProblem(f"{name} is {bitmask.dtype} {tuple(bitmask.shape)}; a 2:4 bitmask of a [{m}, {k}] weight "
                             f"is uint8 [{m}, {k // 8}] (K a multiple of 8)")
    lut = torch.tensor(_NIBBLE_TO_BYTE, dtype=torch.int32, device=bitmask.device)
    b = bitmask.to(torch.int32)
    low, high = lut[b & 0xF], lut[b >> 4]  # packbits is little-endian: group 2j is the low nibble
    bad = (low < 0) | (high < 0)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        group = 2 * col + int(low[row, col] >= 0)
        kept = bin(int(b[row, col]) >> (4 * (group % 2)) & 0xF).count("1")
        raise InvalidProblem(f"{name}: row {row}, group {group} keeps {kept} of 4, not 2: the checkpoint is not 2:4 "
                             f"(or not sparse-24-bitmask)")
    return (low | (high << 8)).to(torch.int16)


def metadata_to_bitmask(metadata: torch.Tensor) -> torch.Tensor:
    """kernelplan metadata ``[M, K/8]`` -> compressed-tensors' packed keep-mask ``[M, K/8]`` uint8."""
    word = metadata.to(torch.int32)

    def nibble(byte):
        return (1 << (byte & 0x3)) | (1 << ((byte >> 2) & 0x3))

    return (nibble(word & 0xFF) | (nibble((word >> 8) & 0xFF) << 4)).to(torch.uint8)


def read_config(path: str | os.PathLike) -> dict:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise InvalidProblem(f"{path} has no config.json: pass a Hugging Face model directory (config.json and "
                             f"model*.safetensors)")
    return json.loads(cfg.read_text())


def _record(config: dict) -> dict | None:
    """kernelplan's record in config.json: ``quantization_config`` naming ``quant_method`` kernelplan, or the top-level
    ``kernelplan`` key that kernelplan wrote before it registered a transformers quantizer."""
    record = config.get("quantization_config")
    if isinstance(record, dict) and record.get("quant_method") == QUANT_METHOD:
        return record
    legacy = config.get("kernelplan")
    return legacy if isinstance(legacy, dict) and legacy.get("format") == FORMAT_NAME else None


def checkpoint_format(config: dict) -> str:
    """kernelplan, sparse-24-bitmask or dense, from config.json."""
    sparsity = (config.get("quantization_config") or {}).get("sparsity_config") or {}
    fmt = sparsity.get("format")
    record = _record(config)
    if record is not None:
        if record.get("format") != FORMAT_NAME:
            raise InvalidProblem(f"config.json's kernelplan record names format {record.get('format')!r}; this "
                                 f"kernelplan reads {FORMAT_NAME!r}: the file was edited, or written by a newer "
                                 f"kernelplan (upgrade kernelplan)")
        version = record.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidProblem(f"config.json's kernelplan format_version is {version!r}; kernelplan records a "
                                 f"positive integer: the file was edited, or not written by kernelplan")
        if version > FORMAT_VERSION:
            raise InvalidProblem(f"config.json records kernelplan format version {version}, newer than this "
                                 f"kernelplan's {FORMAT_VERSION}: upgrade kernelplan")
        return "kernelplan"
    if fmt == "sparse-24-bitmask":
        return fmt
    if fmt not in (None, "dense"):
        raise InvalidProblem(f"config.json names sparsity format {fmt!r}; kernelplan reads sparse-24-bitmask, dense "
                             f"2:4 and its own")
    return "dense"


def holds_2_4(config: dict) -> bool:
    """Whether config.json says the checkpoint is 2:4 already (kernelplan's, the bitmask, or dense 2:4)."""
    sparsity = (config.get("quantization_config") or {}).get("sparsity_config") or {}
    return checkpoint_format(config) != "dense" or sparsity.get("sparsity_structure") == "2:4"


def shards(path: str | os.PathLike) -> list[Path]:
    path = Path(path)
    index = path / INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise InvalidProblem(f"{path} has neither {INDEX} nor model.safetensors")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise InvalidProblem(f"{path}: the index names {missing[0]}, which is missing; the download is incomplete")
    return [path / f for f in files]


def iter_tensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory, one at a time, on ``device``."""
    from safetensors import safe_open

    for shard in shards(path):
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_layers(path: str | os.PathLike, device: str | torch.device = "cpu", targets: str | None = None,
                plain_on_cpu: bool = False) -> Iterator[tuple[str, object]]:
    """``(name, tensor)`` for plain tensors and ``(prefix, Sparse24Weight)`` for 2:4 layers, in any of the formats;
    ``(prefix, [Sparse24Weight of each expert])`` for a MoE layer's stacked experts projection (``kernelplan``).

    ``targets`` (a regex on the layer prefix) chooses which dense ``*.weight``s of a
    ``dense`` 2:4 checkpoint must be 2:4; default: those of the layers
    ``sparsity_config.targets``/``ignore`` name, else every 2-D weight but embeddings and ``lm_head``.
    Every tensor is read on ``device``, or, with ``plain_on_cpu``, the plain ones on the CPU and the 2:4 layers'
    parts (and a dense 2:4 weight, to compress) on ``device``.
    """
    config = read_config(path)
    fmt = checkpoint_format(config)
    sparsity = (config.get("quantization_config") or {}).get("sparsity_config") or {}
    dense24 = fmt == "dense" and sparsity.get("sparsity_structure") == "2:4"
    ignore = [p for p in sparsity.get("ignore", []) if isinstance(p, str)]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    parts = {"kernelplan": ("values", "metadata"), "sparse-24-bitmask": ("compressed", "bitmask", "shape")}.get(fmt, ())
    for name, t in iter_tensors(path, "cpu" if plain_on_cpu else device):
        prefix, _, leaf = name.rpartition(".")
        if leaf in parts:
            got = pending.setdefault(prefix, {})
            got[leaf] = t.to(device)
            if len(got) == len(parts):
                del pending[prefix]
                yield prefix, _weight(fmt, prefix, got)
            continue
        if dense24 and leaf == "weight" and t.dim() == 2 and _targeted(prefix, targets, ignore):
            t = t.to(device)
            if not is_sparse24(t):
                raise InvalidProblem(f"{name} is not 2:4 (a group of 4 holds more than 2 non-zeros), but config.json "
                                     f"says the checkpoint is 2:4: leave the layer out with targets=, or prune it")
            yield prefix, compress(t)
            continue
        yield name, t
    if pending:
        prefix, got = next(iter(pending.items()))
        raise InvalidProblem(f"{prefix} has {sorted(got)} but not all of {list(parts)}: the checkpoint is incomplete")


def layer_shapes(path: str | os.PathLike) -> tuple[str, list[dict]]:
    """The 2:4 layers of a directory, from the safetensors headers alone (no tensor is read): what warmup needs.

    Returns ``(which, layers)``, each layer ``{"name", "m", "k", "bias", "dtype"}``.  ``which`` is
    ``"2:4"`` for a 2:4 checkpoint (any format; a dense 2:4 one's layers are the targeted
    2-D weights, not checked for the pattern here: loading does that), or ``"would prune"``
    for a plain dense checkpoint: the 2-D weights ``kp.sparsify`` prunes by default (not
    embeddings or ``lm_head``).
    """
    from .stream import headers

    config = read_config(path)
    fmt = checkpoint_format(config)
    sparsity = (config.get("quantization_config") or {}).get("sparsity_config") or {}
    ignore = [p for p in sparsity.get("ignore", []) if isinstance(p, str)]
    leaf = {"kernelplan": "values", "sparse-24-bitmask": "compressed"}.get(fmt, "weight")
    found = {name: entry for shard in shards(path) for name, entry in headers(shard).items()}
    layers = []
    for name, (dtype, shape) in found.items():
        prefix, _, last = name.rpartition(".")
        if last != leaf or len(shape) != 2 or (fmt == "dense" and not _targeted(prefix, None, ignore)):
            continue
        m, k = shape[0], shape[1] * (2 if leaf != "weight" else 1)
        layers.append({"name": prefix, "m": m, "k": k, "bias": f"{prefix}.bias" in found, "dtype": dtype})
    return ("2:4" if holds_2_4(config) else "would prune"), layers


def _targeted(prefix: str, targets: str | None, ignore: list[str]) -> bool:
    if targets is not None:
        return re.search(targets, prefix) is not None
    leaf = prefix.rpartition(".")[2]
    if "embed" in prefix or leaf == "lm_head":
        return False
    return not any(prefix == i or prefix.endswith("." + i) or (i.startswith("re:") and re.match(i[3:], prefix))
                   for i in ignore)


def _weight(fmt: str, prefix: str, got: dict[str, torch.Tensor]) -> Sparse24Weight | list[Sparse24Weight]:
    if fmt == "kernelplan" and got["values"].dim() == 3:  # a MoE layer's experts, stacked: one weight an expert
        if got["metadata"].dim() != 3 or got["metadata"].shape[0] != got["values"].shape[0]:
            raise InvalidProblem(f"{prefix}.values is {tuple(got['values'].shape)} and {prefix}.metadata "
                                 f"{tuple(got['metadata'].shape)}; stacked experts store [E, M, K/2] and [E, M, K/8]")
        return [Sparse24Weight(v, m) for v, m in zip(got["values"], got["metadata"])]
    if fmt == "kernelplan":
        return Sparse24Weight(got["values"], got["metadata"])
    shape = tuple(int(v) for v in got["shape"].flatten().tolist())
    if len(shape) != 2 or tuple(got["compressed"].shape) != (shape[0], shape[1] // 2):
        raise InvalidProblem(f"{prefix}.shape is {shape} and {prefix}.compressed {tuple(got['compressed'].shape)}; "
                             f"a 2:4 layer of shape [M, K] stores compressed [M, K/2]")
    return Sparse24Weight(got["compressed"], bitmask_to_metadata(got["bitmask"], shape, f"{prefix}.bitmask"))


_FLOATING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _stored_dtype(path: str | os.PathLike) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating tensor, read from its header alone."""
    from .stream import headers

    for shard in shards(path):
        for dtype, _ in headers(shard).values():
            if dtype in _FLOATING:
                return dtype
    return None


def dense_layer(model: nn.Module, name: str) -> tuple[nn.Module | None, tuple[int, int] | None]:
    """The module at ``name`` (None if there is none) and, where it is a linear layer or a Hugging Face Conv1D, the
    ``[out, in]`` shape a 2:4 weight replacing it has: a Conv1D (GPT-2's) holds its weight transposed, ``[in, out]``."""
    from .pruning.sparsify import is_conv1d

    try:
        layer = model.get_submodule(name)
    except AttributeError:
        return None, None
    if is_conv1d(layer):
        return layer, tuple(layer.weight.shape)[::-1]
    return layer, (tuple(layer.weight.shape) if isinstance(layer, nn.Linear) else None)


def model_class(config):
    """The transformers class a model's config names (``architectures``, which ``save_pretrained`` and
    ``kp.hf.save_model`` write: ``BertModel``, ``BertForSequenceClassification``, ``LlamaForCausalLM``), whose
    parameter names the checkpoint holds; ``AutoModelForCausalLM`` where it names none that transformers has."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return transformers.AutoModelForCausalLM


def _build(config, **kwargs) -> nn.Module:
    """``model_class(config)`` built from ``config``: a concrete class through ``_from_config``, as the auto classes'
    ``from_config`` builds theirs."""
    import transformers

    cls = model_class(config)
    return (cls.from_config if cls is transformers.AutoModelForCausalLM else cls._from_config)(config, **kwargs)


def _skeleton(config, dtype: torch.dtype | None) -> nn.Module:
    """The model ``config`` describes, on the CPU, its weights allocated but not initialized (transformers'
    ``no_init_weights``, which its from_pretrained builds under; it moved from modeling_utils in 4.x to
    initialization in 5.x), tied as configured.  Buffers computed in ``__init__`` (rotary frequencies) are kept."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = _build(config, dtype=dtype)
    model.tie_weights()  # transformers 5 ties in the init_weights that no_init_weights skips
    return model


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               targets: str | None = None, fuse: bool = True) -> nn.Module:
    """Build the model from config.json with transformers (no download) and load the checkpoint into it.

    The model is built on the CPU (its dense layers are allocated there and
    dropped as they are replaced); 2:4 layers become ``Sparse24Linear`` straight
    from their compressed tensors, read on ``device``, so no dense copy of them
    reaches the GPU.  ``dtype`` casts floating tensors.  ``fuse``: sibling 2:4 layers that read one
    input run as one GEMM (``kernelplan.nn.fuse_siblings``), gated MLPs with their activation in its epilogue.
    """
    import transformers

    from .nn.experts import ExpertSpan, expert_weight
    from .nn.sparse24_linear import Sparse24Linear
    from .pruning.sparsify import is_conv1d

    read_config(path)  # a missing config.json is named here, not deep inside transformers
    config = transformers.AutoConfig.from_pretrained(str(path))
    # Built in the checkpoint's own dtype (config.json's can be stale: a model cast after it was configured), with
    # its weights left uninitialized: every one is loaded below or the load is refused, and random initialization on
    # the CPU took 84 of load_model's 87 s for a 2B-parameter model (docs/design/0044).
    model = _skeleton(config, dtype or _stored_dtype(path))
    rename = checkpoint_renamer(model)  # transformers' renames as it saved (Mixtral's mlp as block_sparse_moe), undone
    state, sparse, stacked = {}, set(), {}
    by_expert: dict[str, dict[int, object]] = {}  # "<experts>.<projection>" -> {e: its 2:4 weight, or its bias}
    spans: dict[str, ExpertSpan] = {}  # "<experts>.<projection>" -> where its experts are laid out as they are read
    # The plain tensors (embeddings, norms, an LM head) are read on the CPU, where the model is built, and reach the
    # device once, with the model: read there, they were on it twice while the model moved (0044).
    for name, item in iter_layers(path, device, targets, plain_on_cpu=True):
        if dtype is not None and isinstance(item, Sparse24Weight):
            item = item.to(dtype=dtype)
        if isinstance(item, list):  # an experts projection: built with its module's biases, after the state loads
            name = rename_prefix(rename, name)
            stacked[name] = [w.to(dtype=dtype) if dtype is not None else w for w in item]
            sparse.add(name)
            continue
        if not isinstance(item, Sparse24Weight):
            name = rename(name)
            item = item.to(dtype) if dtype is not None and item.is_floating_point() else item
            expert = per_expert(model, name.removesuffix(".bias")) if name.endswith(".bias") else None
            if expert is not None:  # a bias of one expert's layer, as a Sparse24Experts holds it
                by_expert.setdefault(f"{expert[0]}.{expert[1]}_bias", {})[expert[2]] = item
                continue
            state[name] = item
            continue
        name = rename_prefix(rename, name)
        expert = per_expert(model, name)
        if expert is not None:  # one expert's layer, as a Sparse24Experts holds it (its save_pretrained)
            key = f"{expert[0]}.{expert[1]}"
            if key not in spans:
                module = model.get_submodule(expert[0])
                spans[key] = ExpertSpan(getattr(module, expert[1]).shape[0],
                                        expert_weight(module, expert[1], 0).shape, item.values)
            # Laid out into its rows of the projection's span as it is read, its public tensors dropped: the GPU
            # holds one expert's checkpoint tensors at a time, not every expert's of the model (docs/design/0046).
            by_expert.setdefault(key, {})[expert[2]] = spans[key].laid_out(expert[2], item)
            sparse.add(key)
            continue
        layer, shape = dense_layer(model, name)
        if shape != tuple(item.shape):
            there = type(layer).__name__ if layer is not None else "no module"
            raise InvalidProblem(f"{name} holds a 2:4 weight of shape {tuple(item.shape)}, but the model built from "
                                 f"config.json has {there} there")
        values = item.values
        bias = torch.zeros(shape[0], dtype=values.dtype, device=device) if layer.bias is not None else None
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        replacement = Sparse24Linear(values, item.metadata, bias, _validate=False)
        replacement.from_conv1d = is_conv1d(layer)
        setattr(parent, name.rpartition(".")[2], replacement)
        sparse.update((f"{name}.values", f"{name}.metadata"))
    while by_expert:  # stacked in expert order, every expert there; the lists alone hold the tensors then
        key = next(iter(by_expert))
        experts = model.get_submodule(key.rpartition(".")[0])
        items = stack_experts(key.removesuffix("_bias"), by_expert.pop(key),
                              getattr(experts, key.rpartition(".")[2]).shape[0])
        if key.endswith("_bias"):
            state[key] = torch.stack(items)
        else:
            stacked[key] = items
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in sparse and k not in _tied_and_loaded(model, state)]
    if missing or result.unexpected_keys:
        moe = any(".experts." in k for k in [*missing, *result.unexpected_keys])
        unmarked = checkpoint_format(read_config(path)) == "dense" and any(
            k.endswith((".values", ".metadata")) for k in result.unexpected_keys)
        raise InvalidProblem(f"{path}: the checkpoint does not fit the model config.json builds: missing "
                             f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}" + (
                                 "; a MoE model's dense experts are stored per expert (save_pretrained writes them "
                                 "so) and transformers stacks them as it loads, which this loader does not: load it "
                                 "with transformers.AutoModelForCausalLM.from_pretrained(path) after "
                                 "kp.hf.register_quantizer(), which reads its 2:4 layers too" if moe else
                                 "; it holds 2:4 layers in kernelplan's format, but config.json does not say so (a "
                                 "model whose 2:4 layers were made without kp.sparsify, saved by save_pretrained): "
                                 "save it with kp.hf.save_model, or call kp.hf.mark_config(model) before "
                                 "save_pretrained" if unmarked else ""))
    _load_experts(model, stacked)
    if sparse:
        mark_config(model)
    model = model.to(device).eval()
    if fuse:
        from .nn.siblings import fuse_siblings

        fuse_siblings(model)
    return model


def _tied_and_loaded(model: nn.Module, state: dict) -> set[str]:
    """The names of parameters tied to one that ``state`` loads (one tensor under several names, as the model's
    ``tie_weights`` left it: an LM head and its embeddings, T5's shared embeddings and each stack's): a checkpoint
    holds such a tensor once."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n for group in names.values() if len(group) > 1 and any(g in state for g in group) for n in group}


def experts_module(model: nn.Module, prefix: str) -> nn.Module:
    """The experts module at ``prefix``, where a checkpoint holds stacked 2:4 experts; refused where the model built
    from config.json has none there, or one ``Sparse24Experts`` cannot hold."""
    from .nn.experts import experts_reason

    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        module = None
    reason = "there is no module there" if module is None else experts_reason(module)
    if reason is not None:
        raise InvalidProblem(f"{prefix} holds 2:4 stacked experts, but the model built from config.json has a "
                             f"{type(module).__name__} there that cannot hold them: {reason}")
    return module


def _load_experts(model: nn.Module, stacked: dict[str, list[Sparse24Weight]]) -> None:
    """Replace each experts module whose projections the checkpoint holds 2:4 (``{param name: weights}``) with a
    ``Sparse24Experts`` of them; its biases and the rest are the module's, loaded already.  Each module's checkpoint
    weights leave ``stacked`` as it is built, so the GPU holds them and the built layout together for one module at a
    time, not for the whole model (docs/design/0045)."""
    from .nn.experts import Sparse24Experts, expert_weight, parts_of

    for prefix in dict.fromkeys(name.rpartition(".")[0] for name in stacked):
        module = experts_module(model, prefix)
        pruned = {}
        for part in parts_of(module):
            weights = stacked.pop(f"{prefix}.{part}", None)
            count, want = getattr(module, part).shape[0], tuple(expert_weight(module, part, 0).shape)
            if weights is None or len(weights) != count or any(tuple(w.shape) != want for w in weights):
                got = "nothing" if weights is None else \
                    f"{len(weights)} 2:4 experts of {' or '.join(sorted({str(list(w.shape)) for w in weights}))}"
                raise InvalidProblem(f"{prefix}.{part}: the checkpoint holds {got} ([out, in]), and the model built "
                                     f"from config.json has {count} experts of {list(want)} there; a checkpoint "
                                     f"holds both projections of an experts module 2:4, or neither")
            pruned[part] = weights
        parent = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
        del weights  # pruned alone holds the checkpoint's tensors now, and from_experts frees them as it lays out
        setattr(parent, prefix.rpartition(".")[2], Sparse24Experts.from_experts(module, pruned, consume=True))


def experts_modules(path: str | os.PathLike) -> list[str]:
    """The MoE experts modules (stacked 3-D weights that ``Sparse24Experts`` holds) of the model config.json builds,
    found on the meta device: no weight is read."""
    import transformers

    from .nn.experts import experts_reason
    from .pruning.sparsify import _three_d

    with torch.device("meta"):
        model = _build(transformers.AutoConfig.from_pretrained(str(path)))
    return [name for name, m in model.named_modules() if _three_d(m) and experts_reason(m) is None]


def load_for_pruning(path: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """The model of a directory, in memory, to prune: a dense checkpoint through transformers' own loader (which
    stacks a MoE model's per-expert tensors into its experts modules, as ``load_model`` cannot), a 2:4 one through
    ``load_model``."""
    if holds_2_4(read_config(path)):
        return load_model(path, device)
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    model = model_class(config).from_pretrained(str(path), dtype=_stored_dtype(path))
    return model.to(device).eval()


def _marker() -> dict:
    return {"quant_method": QUANT_METHOD, "format": FORMAT_NAME, "format_version": FORMAT_VERSION}


def _foreign_method(config) -> str | None:
    """The quantization method a model's config records, where it is neither kernelplan's nor a compressed-tensors
    sparsity record (which a model of 2:4 layers replaces); None otherwise."""
    record = getattr(config, "quantization_config", None)
    if record is None:
        return None
    get = record.get if isinstance(record, dict) else lambda key: getattr(record, key, None)
    method = get("quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method == QUANT_METHOD or (method == "compressed-tensors" and get("sparsity_config")):
        return None
    return str(method)


def check_markable(model: nn.Module) -> None:
    """Refuse, before any work, a model whose config records another quantization method: its config.json has one
    ``quantization_config``, and a model with 2:4 layers records kernelplan's format there."""
    method = _foreign_method(getattr(model, "config", None))
    if method is not None:
        raise InvalidProblem(f"model.config.quantization_config records quant_method {method!r}: the model is "
                             f"quantized by {method}, and kernelplan's 2:4 layers do not combine with it (its "
                             f"config.json could not describe both); sparsify the unquantized model")


def mark_config(model: nn.Module) -> None:
    """Record kernelplan's format in a Hugging Face model's config (``config.quantization_config``, quant_method
    kernelplan), once the model holds 2:4 layers: their state_dict is kernelplan's format (``p.values``,
    ``p.metadata``), whatever checkpoint they came from, so the model's own ``save_pretrained`` writes a directory
    that ``load_model`` reads, and transformers' ``from_pretrained`` too once ``register_quantizer`` has run (this
    runs it).  A compressed-tensors sparsity record no longer describes that state_dict and is replaced.  A model
    without a transformers config is left as it is."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return
    check_markable(model)
    config.quantization_config = _marker()
    if "kernelplan" in vars(config):  # the record's place before kernelplan registered a quantizer
        del config.kernelplan
    if "transformers" in sys.modules:
        try:
            register_quantizer()
        except (ImportError, AttributeError, TypeError, ValueError) as e:  # must not fail the pruning it follows
            warn(f"kernelplan could not register its transformers quantizer ({e!r}): from_pretrained will not read "
                 f"this model's 2:4 directory; kp.hf.load_model(path) does", UserWarning, stacklevel=2)


def register_quantizer() -> None:
    """Register kernelplan's quantization method with transformers, so ``AutoModelForCausalLM.from_pretrained(path)``
    (and code built on it: pipelines, lm-eval's ``HFLM(pretrained=path)``) loads a kernelplan 2:4 directory as
    ``Sparse24Linear`` layers (``kernelplan/hf_quantizer.py``).  Idempotent; call it once in a process before
    ``from_pretrained`` (``kp.sparsify`` and ``load_model`` call it)."""
    from transformers.quantizers import auto

    if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:
        return
    from .hf_quantizer import Sparse24QuantConfig, Sparse24Quantizer

    auto.register_quantization_config(QUANT_METHOD)(Sparse24QuantConfig)
    auto.register_quantizer(QUANT_METHOD)(Sparse24Quantizer)


def _write_config(out: Path, config: dict, format: str, ignore: list[str]) -> None:
    """config.json with the 2:4 format recorded where its readers look (compressed-tensors' ``quantization_config``);
    ``ignore``: the linear layers left dense."""
    config = dict(config)
    config.pop("quantization_config", None)
    config.pop("kernelplan", None)
    if format == "kernelplan":
        config["quantization_config"] = _marker()
    else:
        config["quantization_config"] = {
            "version": "0.14.0", "quant_method": "compressed-tensors", "transform_config": {},
            "sparsity_config": {"format": format, "sparsity_structure": "2:4", "targets": ["Linear"],
                                "ignore": ignore, "global_sparsity": 0.5, "registry_requires_subclass": False}}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _refuse_dense_conv1d(names: list[str]) -> None:
    """The dense format writes each 2:4 layer as the dense weight its model's own layer holds, and reads them back
    as [out, in]; a Conv1D (GPT-2's) holds its weight transposed, [in, out]."""
    if names:
        raise InvalidProblem(f"format='dense' cannot hold {names[0]} ({len(names)} such layers): it replaced a Hugging "
                             f"Face Conv1D, whose checkpoints store the weight transposed, and the dense 2:4 format is "
                             f"read back as [out, in]; write format='kernelplan' or format='sparse-24-bitmask'")


def _stored(format: str, prefix: str, values: torch.Tensor, metadata: torch.Tensor) -> dict[str, torch.Tensor]:
    """A 2:4 layer's tensors as ``format`` stores them."""
    if format == "kernelplan":
        return {f"{prefix}.values": values, f"{prefix}.metadata": metadata}
    if format == "sparse-24-bitmask":
        m, half = values.shape
        return {f"{prefix}.compressed": values, f"{prefix}.bitmask": metadata_to_bitmask(metadata),
                f"{prefix}.shape": torch.tensor([[m], [2 * half]])}
    return {f"{prefix}.weight": Sparse24Weight(values, metadata).decompress()}


def sparsify_directory(src: str | os.PathLike, dst: str | os.PathLike, format: str = "kernelplan",
                       filter_fn=None, dry_run: bool = False):
    """Magnitude 2:4 of a dense Hugging Face directory, shard by shard and tensor by tensor: what
    ``save_model(sparsify(load_model(src)), dst, format)`` writes, holding one output shard at a time.

    Which layers are pruned is decided as ``kp.sparsify`` decides it, on the model built from
    config.json on the meta device (no memory): its linear layers, not embeddings, a tied or output
    LM head.  Each input shard gives one output shard.
    """
    import transformers
    from safetensors.torch import save_file

    from ._checks import choice
    from .pruning.sparsify import SparsifyReport, _select, is_conv1d
    from .stream import headers, prune_compress_rows, read_tensor

    format = choice(format, "format", FORMATS)
    config = read_config(src)
    if holds_2_4(config):
        raise InvalidProblem(f"{src} is a 2:4 checkpoint already ({checkpoint_format(config)}); sparsify a dense one")
    with torch.device("meta"):
        model = _build(transformers.AutoConfig.from_pretrained(str(src)), dtype=_stored_dtype(src))
    report = SparsifyReport()
    conv1d = {name for name, m in model.named_modules() if is_conv1d(m)}  # stored [in, out]: read transposed
    chosen = {name for name, _ in _select(model, filter_fn, False, report, experts_dense=(
        "a MoE layer's experts: checkpoints store them per expert, and transformers stacks them as it loads, so "
        "this tensor-by-tensor path cannot match them to the model; `kernelplan sparsify` with --calibration "
        "(the model in memory, loaded by transformers), or kp.sparsify of the model, holds them 2:4 "
        "(docs/design/0032). They are copied dense"))}
    if format == "dense":
        _refuse_dense_conv1d(sorted(conv1d & chosen))
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    out, files, weight_map, total = Path(dst), [], {}, 0
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
    for shard in shards(src):
        tensors = {}
        for name in headers(shard):
            prefix, _, leaf = name.rpartition(".")
            if not (leaf == "weight" and prefix in chosen):
                tensors[name] = None if dry_run else read_tensor(shard, name)
                continue
            report.converted.append(prefix)
            if dry_run:
                continue
            t = read_tensor(shard, name)
            values, metadata = prune_compress_rows(t.t().contiguous() if prefix in conv1d else t)
            report.bytes_before += t.numel() * t.element_size()
            report.bytes_after += values.nbytes + metadata.nbytes
            tensors.update(_stored(format, prefix, values, metadata))
            del t, values, metadata
        if dry_run:
            continue
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / shard.name), metadata={"format": "pt"})
        files.append(shard.name)
        weight_map.update(dict.fromkeys(tensors, shard.name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if dry_run:
        return report
    if len(files) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _write_config(out, config, format, sorted(linears - chosen))
    return report


def save_model(model: nn.Module, path: str | os.PathLike, format: str = "kernelplan",
               max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write ``model`` (its ``Sparse24Linear`` layers in ``format``) as a Hugging Face directory; return the files.

    Shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own),
    an index when there is more than one, and config.json with the format recorded
    where its readers look (compressed-tensors' ``quantization_config``).  Tied
    weights are written once, as ``save_pretrained`` does.
    """
    from safetensors.torch import save_file

    from ._checks import choice
    from .nn.experts import Sparse24Experts
    from .nn.sparse24_linear import Sparse24Linear

    format = choice(format, "format", FORMATS)
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Sparse24Experts)}
    if experts and format == "sparse-24-bitmask":
        raise InvalidProblem(
            f"{next(iter(experts))} is a Sparse24Experts (a MoE layer's experts, stacked as transformers holds them): "
            f"compressed-tensors' sparse-24-bitmask format stores experts as per-expert linear layers under each "
            f"model's own checkpoint names, which kernelplan does not write. Save with format='kernelplan' (the "
            f"experts stacked, 2:4; load_model reads it) or format='dense' (the pruned weights, which transformers "
            f"reads)")
    sparse = {name for name, m in model.named_modules() if isinstance(m, Sparse24Linear)}
    if format == "dense":
        _refuse_dense_conv1d(sorted(n for n in sparse if model.get_submodule(n).from_conv1d))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            continue  # a tied weight
        seen.add(key)
        owner = next((e for e in experts if name.startswith(e + ".")), None)
        if owner is not None:  # written once, below, as the transformers module holds it
            continue
        if prefix in sparse and leaf in ("values", "metadata"):
            if leaf == "metadata":
                continue
            layer = model.get_submodule(prefix)
            values, metadata = layer.weight24.public().values.detach(), layer.weight24.public().metadata
            if format == "kernelplan":
                tensors[f"{prefix}.values"], tensors[f"{prefix}.metadata"] = values, metadata
            elif format == "sparse-24-bitmask":
                tensors[f"{prefix}.compressed"] = values
                tensors[f"{prefix}.bitmask"] = metadata_to_bitmask(metadata)
                tensors[f"{prefix}.shape"] = torch.tensor([[layer.out_features], [layer.in_features]])
            else:
                tensors[f"{prefix}.weight"] = layer.to_dense()
            continue
        tensors[name] = t.detach()
    for prefix, mod in experts.items():
        parts = mod.dense_parts() if format == "dense" else mod.stacked_parts()
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
        if mod.post_expert_norm is not None:
            tensors.update({f"{prefix}.post_expert_norm.{k}": t for k, t in mod.post_expert_norm.state_dict().items()})
    groups, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for fname, names in zip(files, groups):
        save_file({n: tensors[n].contiguous().cpu() for n in names}, str(out / fname), metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {n: f for f, names in zip(files, groups) for n in names}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        files.append(INDEX)
    config = model.config.to_dict() if hasattr(model, "config") else {}
    if config and not config.get("architectures"):  # as save_pretrained records it: the class load_model builds
        config["architectures"] = [type(model).__name__]
    _write_config(out, config, format, sorted(n for n, m in model.named_modules()
                                              if isinstance(m, nn.Linear) and n not in sparse))
    return files + ["config.json"]
