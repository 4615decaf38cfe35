"""``kernelplan sparsify IN.safetensors OUT.safetensors`` tensor by tensor: memory bounded by one layer, not the file.

The output is the same file ``save_compressed(sparsify_state_dict(load_file(IN)))``
writes (same tensors, same metadata, same checksum), so ``load_compressed``
reads it.  safetensors' own writers take every tensor at once, so this writes
the format itself (the header, a little-endian u64 of its length then JSON, and
each tensor's bytes at its offsets), as the format's spec defines it:

* which tensors are pruned, and every output's shape and dtype, are decided
  from IN's header alone (``checkpoint.plan_tensor``);
* the header is written first with a placeholder checksum of the same length;
* tensors are read from IN one at a time, pruned where planned and written in
  the checksum's order (by name); a layer's ``values`` wait in memory from its
  ``metadata`` (written first, by name) until their turn;
* the header is written again with the checksum, then the file renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

from . import __version__
from .errors import InvalidProblem
from .pruning.sparsify import SparsifyReport

# torch dtype -> the safetensors spec's name
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def headers(path: str) -> dict[str, tuple[torch.dtype | str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a safetensors file, from its header alone; a dtype outside
    ``SAFETENSORS_DTYPES`` stays the spec's name (a str)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (BY_NAME.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError) as e:
        raise InvalidProblem(f"{path} is not a safetensors file ({e})") from e


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor, the file opened for it alone: safetensors maps the whole file, and every page read stays in
    the process's resident set while the mapping is open (the whole input, by the end, if it stayed open)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def prune_compress_rows(w: torch.Tensor, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``prune_compress(w)``'s values and metadata, a block of rows at a time: groups of 4 lie along a row, so
    blocks are independent, and pruning's temporaries (about 8x a block's bytes on the CPU) stay a block's."""
    from .sparse24.format import prune_compress

    m, k = w.shape
    values = torch.empty(m, k // 2, dtype=w.dtype)
    metadata = torch.empty(m, k // 8, dtype=torch.int16)
    for r in range(0, m, rows):
        block = prune_compress(w[r:r + rows])
        values[r:r + rows], metadata[r:r + rows] = block.values, block.metadata
    return values, metadata


def sparsify_file(src: str, dst: str, pattern: str | None = None, dry_run: bool = False,
                  transposed: str = "auto") -> SparsifyReport:
    """Prune and compress ``src``'s eligible 2-D weights into ``dst``, one tensor in memory at a time.  Weights
    stored [in, out] (``checkpoint.transposed_weights``: GPT-2's Conv1D) are pruned and written as the linear
    layer's [out, in]."""
    from .checkpoint import (FORMAT_NAME, _write_atomically, compile_filter, compressed_bytes, plan_tensor,
                             transposed_weights)
    from .sparse24.format import FORMAT_VERSION

    regex = compile_filter(pattern)
    if not os.path.isfile(src):
        raise InvalidProblem(f"{src} does not exist or is not a file")
    found = headers(src)
    odd = next(((name, d) for name, (d, _) in found.items() if isinstance(d, str)), None)
    if odd is not None:
        raise InvalidProblem(f"{src}: {odd[0]} has dtype {odd[1]}, which kernelplan does not copy; supported: "
                             f"{', '.join(BY_NAME)}")
    report = SparsifyReport()
    flipped = {name for name in transposed_weights(found, transposed) if len(found[name][1]) == 2}
    outputs: dict[str, tuple[str, str, torch.dtype, tuple]] = {}  # out name -> (in name, part, dtype, shape)
    for name, (dtype, stored) in found.items():
        shape = stored[::-1] if name in flipped else stored  # the linear layer's [out, in]
        reason = plan_tensor(name, dtype, shape, regex)
        if reason == "keep":
            outputs[name] = (name, "as is", dtype, stored)
            continue
        prefix = name[: -len(".weight")]
        if reason is not None:
            report.skipped[prefix] = reason
            outputs[name] = (name, "as is", dtype, stored)
            continue
        m, k = shape
        outputs[prefix + ".values"] = (name, "values", dtype, (m, k // 2))
        outputs[prefix + ".metadata"] = (name, "metadata", torch.int16, (m, k // 8))
        report.converted.append(prefix)
        if name in flipped:
            report.transposed.append(prefix)
        report.bytes_before += m * k * dtype.itemsize
        report.bytes_after += compressed_bytes(m, k, dtype.itemsize)
    if dry_run:
        return report

    names = sorted(outputs)  # the checksum's order (checkpoint._digest), and the file's
    entries, offset = {}, 0
    for name in names:
        _, _, dtype, shape = outputs[name]
        size = dtype.itemsize * int(torch.Size(shape).numel())
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                      offset + size]}
        offset += size
    meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "kernelplan_version": __version__}

    def header(digest: str) -> bytes:
        text = json.dumps({"__metadata__": {**meta, "sha256": digest}, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the spec allows trailing spaces; 8-byte aligned data
        return struct.pack("<Q", len(text)) + text

    def write(tmp: str) -> None:
        h = hashlib.sha256()
        waiting: dict[str, torch.Tensor] = {}  # a layer's values, from its metadata's turn to its own
        with open(tmp, "wb") as out:
            out.write(header("0" * 64))
            for name in names:
                source, part, dtype, shape = outputs[name]
                if part == "as is":
                    t = read_tensor(src, source)
                elif name in waiting:
                    t = waiting.pop(name)
                else:
                    w = read_tensor(src, source)
                    values, metadata = prune_compress_rows(w.t().contiguous() if source in flipped else w)
                    t, other = (values, metadata) if part == "values" else (metadata, values)
                    waiting[source[: -len(".weight")] + (".metadata" if part == "values" else ".values")] = other
                t = t.contiguous().reshape(-1)
                h.update(f"{name}|{t.dtype}|{tuple(shape)}|".encode())
                raw = memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""  # no copy
                h.update(raw)
                out.write(raw)
                del t, raw
            out.seek(0)
            out.write(header(h.hexdigest()))

    _write_atomically(write, os.fspath(dst))
    return report
