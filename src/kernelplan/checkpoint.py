"""Compressed checkpoints (safetensors) and ``sparsify``: dense models to 2:4 ones.

A compressed checkpoint is a plain safetensors file.  Its metadata names the
format (``kernelplan.sparse24``), the format version, the kernelplan version
and a SHA-256 over every tensor's name, dtype, shape and bytes, so a newer
format, a truncated file or changed bytes are refused with a clear error.  A
2:4 layer ``p`` is stored as ``p.values`` and ``p.metadata`` (the public
format of ``kernelplan.sparse24``), beside its ``p.bias``: exactly the
``state_dict`` of a model whose ``nn.Linear``s ``sparsify`` replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from . import __version__
from .errors import InvalidProblem
from .nn.sparse24_linear import Sparse24Linear
from .sparse24.format import FORMAT_VERSION, SPARSE24_DTYPES, Sparse24Weight

FORMAT_NAME = "kernelplan.sparse24"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)  # 1-D: a 0-d tensor has no byte view
        h.update(f"{name}|{t.dtype}|{tuple(tensors[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_compressed(model_or_state_dict: nn.Module | dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a model's (or a state dict's) tensors to ``path`` as a compressed checkpoint."""
    from safetensors.torch import save_file

    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InvalidProblem("model_or_state_dict must be an nn.Module or a dict of tensors")
    tensors, seen = {}, set()
    for name, t in state.items():
        t = t.detach().contiguous()
        key = (t.untyped_storage().data_ptr(), t.device) if t.numel() else None
        # safetensors refuses tensors that share memory (tied weights): store such a one as a copy.
        tensors[name] = t.clone() if key in seen else t
        seen.add(key)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kernelplan_version": __version__,
        "sha256": _digest(tensors),
    }
    _write_atomically(lambda tmp: save_file(tensors, tmp, metadata=metadata), os.fspath(path))


def _write_atomically(write, path: str) -> None:
    """``write(temporary path)`` beside ``path``, then a rename: an interrupted write leaves no half file."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InvalidProblem(f"{path} is a directory; pass the path of the .safetensors file to write in it")
    if not os.path.isdir(folder):
        raise InvalidProblem(f"{path}: its directory {folder} does not exist; create it first (mkdir -p)")
    if not os.access(folder, os.W_OK):
        raise InvalidProblem(f"{path}: its directory {folder} is not writable; write somewhere else")
    from safetensors import SafetensorError

    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        raise InvalidProblem(f"{path} could not be written ({e}); check the disk space and permissions") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def load_compressed(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a compressed checkpoint into a state dict on ``device``, checking format and integrity."""
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidProblem(f"{path} does not exist or is not a file: pass the path of a .safetensors checkpoint")
    if not os.access(path, os.R_OK):
        raise InvalidProblem(f"{path} exists but cannot be read (permission denied): fix its permissions")
    try:
        with safe_open(path, framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise InvalidProblem(f"{path} is not a readable safetensors file ({e}); it may be truncated or another format") from e
    if meta.get("format") != FORMAT_NAME:
        raise InvalidProblem(
            f"{path} has format {meta.get('format')!r}, not {FORMAT_NAME!r}: write it with kernelplan.save_compressed "
            f"or the `kernelplan sparsify` command"
        )
    raw = meta.get("format_version")
    version = int(raw) if isinstance(raw, str) and raw.isdigit() else None
    if version is None or version < 1:
        raise InvalidProblem(
            f"{path} has format_version {raw!r}; a kernelplan checkpoint records a positive integer: the file "
            f"was not written by kernelplan.save_compressed or its metadata was edited"
        )
    if version > FORMAT_VERSION:
        raise InvalidProblem(
            f"{path} has format version {version}, newer than this kernelplan's {FORMAT_VERSION} "
            f"(written by kernelplan {meta.get('kernelplan_version')}): upgrade kernelplan"
        )
    if _digest(tensors) != meta.get("sha256"):
        raise InvalidProblem(f"{path}: the tensors do not match the checksum recorded when it was written; "
                             f"the file was changed or damaged after saving")
    for name in tensors:
        stem, _, part = name.rpartition(".")
        if part in ("values", "metadata"):
            other = f"{stem}.{'metadata' if part == 'values' else 'values'}"
            if other not in tensors:
                raise InvalidProblem(f"{path}: {name} has no {other}; a 2:4 layer is stored as both: the file is "
                                     f"incomplete or was edited")
            if part == "metadata":
                Sparse24Weight(tensors[other], tensors[name])  # checks the metadata bits
    return tensors


@dataclass
class SparsifyReport:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why it stayed dense
    bytes_before: int = 0  # weights of the converted layers, dense
    bytes_after: int = 0  # the same layers, compressed

    def summary(self) -> str:
        saved = self.bytes_before - self.bytes_after
        lines = [f"converted {len(self.converted)} layers: {self.bytes_before / 2**20:.2f} MiB -> "
                 f"{self.bytes_after / 2**20:.2f} MiB ({saved / 2**20:.2f} MiB saved)"]
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def eligibility(weight: torch.Tensor) -> str | None:
    """Why a 2-D weight cannot be stored 2:4, or None if it can."""
    from .dtypes import dtype_info

    info = dtype_info(weight.dtype) if weight.is_floating_point() else None
    if info is None or info.name not in SPARSE24_DTYPES:
        return f"dtype {weight.dtype} is not one of {SPARSE24_DTYPES}"
    if weight.dim() != 2:
        return f"weight has {weight.dim()} dims; only 2-D weights are pruned"
    if weight.shape[1] % 8:
        return f"in_features={weight.shape[1]} is not a multiple of 8"
    return None


def _compressed_bytes(weight: torch.Tensor) -> int:
    m, k = weight.shape
    return m * k // 2 * weight.element_size() + m * k // 8 * 2


def sparsify(
    model: nn.Module, filter_fn: Callable[[str, nn.Linear], bool] | None = None, progress: bool = True,
    prune_output: bool = False,
) -> SparsifyReport:
    """Replace every eligible ``nn.Linear`` of ``model`` in place with a 2:4 ``Sparse24Linear``.

    Skipped, with the reason in the report: layers ``filter_fn`` rejects; layers
    whose weight is shared with another parameter (a tied LM head: pruning it
    would break the tie, or prune the embeddings too); and, unless
    ``prune_output``, the model's output projection (``get_output_embeddings()``
    of a Hugging Face model, else a layer named ``lm_head``), whose pruning harms
    accuracy most and which is not where 2:4 speeds a model up.
    """
    from tqdm.auto import tqdm

    if not isinstance(model, nn.Module):
        raise InvalidProblem(f"model is a {type(model).__name__}; sparsify takes an nn.Module")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    owners: dict[int, list[str]] = {}  # parameter storage -> the names that hold it, ties included
    for pname, p in model.named_parameters(remove_duplicate=False):
        if p.numel():
            owners.setdefault((p.data_ptr(), tuple(p.shape)), []).append(pname)
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    report = SparsifyReport()
    for name, layer in tqdm(linears, desc="sparsify", disable=not progress or len(linears) < 8):
        if not name:
            report.skipped["<model>"] = "the model itself is an nn.Linear: use Sparse24Linear.from_dense(model)"
            continue
        if filter_fn is not None and not filter_fn(name, layer):
            report.skipped[name] = "filtered out by filter_fn"
            continue
        w = layer.weight
        tied = [o for o in owners.get((w.data_ptr(), tuple(w.shape)), []) if o != f"{name}.weight"]
        if tied:
            report.skipped[name] = (f"its weight is tied to {', '.join(tied)}: pruning it would prune those too, "
                                    f"or break the tie")
            continue
        if not prune_output and (layer is output or (output is None and name.rpartition(".")[2] == "lm_head")):
            report.skipped[name] = "the output projection (LM head) stays dense by default: prune_output=True prunes it"
            continue
        reason = eligibility(layer.weight)
        if reason is not None:
            report.skipped[name] = reason
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        sparse = Sparse24Linear.from_dense(layer)
        setattr(parent, name.rpartition(".")[2], sparse)
        report.converted.append(name)
        report.bytes_before += layer.weight.numel() * layer.weight.element_size()
        report.bytes_after += sparse.values.nbytes + sparse.metadata.nbytes  # as held: the device layout's 0.5625x
    return report


def sparsify_state_dict(state: dict[str, torch.Tensor], pattern: str | None = None) -> tuple[dict, SparsifyReport]:
    """Prune and compress every 2-D ``*.weight`` whose name matches ``pattern`` (a regex; default all).

    ``p.weight`` becomes ``p.values`` and ``p.metadata``; everything else is kept.  Embedding
    tables (names containing "embed") stay dense unless ``pattern`` names them.
    """
    import re

    from .sparse24.format import prune_compress

    try:
        regex = re.compile(pattern) if pattern is not None else None
    except re.error as e:
        raise InvalidProblem(f"filter {pattern!r} is not a valid regular expression: {e}") from e
    out, report = {}, SparsifyReport()
    for name, t in state.items():
        wanted = name.endswith(".weight") and t.dim() == 2 and (regex is None or regex.search(name))
        if not wanted:
            out[name] = t
            continue
        prefix = name[: -len(".weight")]
        reason = eligibility(t)
        if reason is None and regex is None and "embed" in name:
            reason = "an embedding table, not a linear weight (name it in --filter to prune it anyway)"
        if reason is not None:
            report.skipped[prefix] = reason
            out[name] = t
            continue
        w24 = prune_compress(t)
        out[prefix + ".values"], out[prefix + ".metadata"] = w24.values, w24.metadata
        report.converted.append(prefix)
        report.bytes_before += t.numel() * t.element_size()
        report.bytes_after += _compressed_bytes(t)
    return out, report
