"""Compressed checkpoints (safetensors), and ``sparsify_state_dict``: a dense checkpoint to a 2:4 one.

A compressed checkpoint is a plain safetensors file.  Its metadata names the
format (``kernelplan.sparse24``), the format version, the kernelplan version
and a SHA-256 over every tensor's name, dtype, shape and bytes, so a newer
format, a truncated file or changed bytes are refused with a clear error.  A
2:4 layer ``p`` is stored as ``p.values`` and ``p.metadata`` (the public
format of ``kernelplan.sparse24``), beside its ``p.bias``: exactly the
``state_dict`` of a model whose ``nn.Linear``s ``kernelplan.sparsify`` replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re

import torch
from torch import nn

from . import __version__
from .errors import InvalidProblem
from .pruning.sparsify import SparsifyReport, eligibility
from .sparse24.format import FORMAT_NAME, FORMAT_VERSION, Sparse24Weight


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


def compressed_bytes(m: int, k: int, itemsize: int) -> int:
    """Bytes an [m, k] weight holds as 2:4 values and metadata."""
    return m * k // 2 * itemsize + m * k // 8 * 2


def compile_filter(pattern: str | None):
    try:
        return re.compile(pattern) if pattern is not None else None
    except re.error as e:
        raise InvalidProblem(f"filter {pattern!r} is not a valid regular expression: {e}") from e


# Hugging Face's GPT-2 family (GPT2, ImageGPT, DecisionTransformer's GPT-2) builds these projections as Conv1D,
# whose weight is stored [in, out], and its files hold the token and position tables wte and wpe.  OpenCLIP names
# its nn.Linear projections c_fc and c_proj too, beside token_embedding: no wte or wpe there.
_CONV1D_SUFFIXES = (".c_attn.weight", ".q_attn.weight", ".c_fc.weight", ".c_proj.weight")


def transposed_weights(names, transposed: str = "auto") -> set[str]:
    """Which of ``names`` are weights stored [in, out] (a Conv1D's), to be pruned as the linear layer's [out, in]:
    ``"auto"``: GPT-2's Conv1D projections, where the names show that family (a ``wte.weight`` and a
    ``wpe.weight``); ``"none"``; or a regular expression of the names."""
    names = list(names)
    if transposed == "none":
        return set()
    if transposed == "auto":
        family = all(any(n == table or n.endswith("." + table) for n in names)
                     for table in ("wte.weight", "wpe.weight"))
        return {n for n in names if n.endswith(_CONV1D_SUFFIXES)} if family else set()
    try:
        regex = re.compile(transposed)
    except re.error as e:
        raise InvalidProblem(f"transposed {transposed!r} is neither 'auto', 'none' nor a valid regular expression: "
                             f"{e}") from e
    return {n for n in names if regex.search(n)}


def plan_tensor(name: str, dtype: torch.dtype, shape: tuple, regex) -> str | None:
    """What ``sparsify_state_dict`` does with a tensor, from its name, dtype and shape alone: ``"keep"`` (not a
    candidate), a reason it stays dense (reported), or None (pruned).  ``regex``: ``compile_filter``'s."""
    if not (name.endswith(".weight") and len(shape) == 2 and (regex is None or regex.search(name))):
        return "keep"
    reason = eligibility(torch.empty(shape, dtype=dtype, device="meta"))
    if reason is None and regex is None and "embed" in name:
        reason = "an embedding table, not a linear weight (name it in --filter to prune it anyway)"
    return reason


def sparsify_state_dict(state: dict[str, torch.Tensor], pattern: str | None = None,
                        transposed: str = "auto") -> tuple[dict, SparsifyReport]:
    """Prune and compress every 2-D ``*.weight`` whose name matches ``pattern`` (a regex; default all).

    ``p.weight`` becomes ``p.values`` and ``p.metadata``; everything else is kept.  Embedding
    tables (names containing "embed") stay dense unless ``pattern`` names them.  Weights stored [in, out]
    (``transposed_weights``: GPT-2's Conv1D) are pruned and stored as the linear layer's [out, in], as
    ``kp.sparsify`` holds them.  (``stream.sparsify_file`` does the same to a file, a tensor at a time.)
    """
    from .sparse24.format import prune_compress

    regex = compile_filter(pattern)
    flipped = transposed_weights(state, transposed)
    out, report = {}, SparsifyReport()
    for name, t in state.items():
        w = t.t() if name in flipped and t.dim() == 2 else t  # the linear layer's [out, in]
        reason = plan_tensor(name, w.dtype, tuple(w.shape), regex)
        if reason == "keep":
            out[name] = t
            continue
        prefix = name[: -len(".weight")]
        if reason is not None:
            report.skipped[prefix] = reason
            out[name] = t
            continue
        w24 = prune_compress(w.contiguous())
        out[prefix + ".values"], out[prefix + ".metadata"] = w24.values, w24.metadata
        report.converted.append(prefix)
        if w is not t:
            report.transposed.append(prefix)
        report.bytes_before += t.numel() * t.element_size()
        report.bytes_after += compressed_bytes(*w.shape, t.element_size())
    return out, report
