"""The 2:4 structured-sparse weight format (kernelplan's public interchange format, v1).

In every group of 4 consecutive weights along K at most 2 are non-zero.  A
weight ``W [M, K]`` is stored as

* ``values   [M, K/2]``: the kept weights, in the weight's dtype;
* ``metadata [M, K/8]``: 16-bit words, two groups per word, low byte first.
  In each byte bits 0-1 are ``pos0`` and bits 2-3 are ``pos1``, ``pos0 < pos1``;
  ``values[m, 2g]`` sits at ``W[m, 4g + pos0]`` and ``values[m, 2g+1]`` at
  ``W[m, 4g + pos1]``.  A group with fewer than 2 non-zeros still names two
  distinct positions (non-zeros first, then the lowest free indices) and
  stores zeros there.

The words are kept in a ``torch.int16`` tensor: every valid byte is at most
``0b1110``, so every valid word is below ``0x8000`` and its int16 value equals
its u16 value -- no sign games.  Backend layouts (cuSPARSELt's buffer, packed
4-bit metadata) are derived from this format and cached on the weight with
:meth:`Sparse24Weight.derived`; they are never the public format.  The one
device layout (``layout.py``) is the exception: a weight may be held in it
alone (``Sparse24Linear`` does), and converts back to this format to be saved.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .._checks import check_has_data, check_tensor
from ..dtypes import dtype_info
from ..errors import InvalidProblem, InvalidState, MisalignedOperand
from .layout import (PUBLIC, SP_LAYOUT, check_layout, gpu_kernels, k_fits, layout_of, pack, pack_reason, padded_k,
                     unpack, weight_shape)

# The name and version kernelplan's checkpoints record (checkpoint.py, stream.py; config.json in hf.py).
FORMAT_NAME = "kernelplan.sparse24"
FORMAT_VERSION = 1
SPARSE24_DTYPES = ("f64", "f32", "f16", "bf16")
# What compress needs of K: the metadata is 4 bits a group of 4 columns, so a byte covers 8 columns.
COMPRESS_K = 8


def _groups(w: torch.Tensor, operand: str, multiple: int) -> torch.Tensor:
    """View ``w [..., K]`` as ``[..., K/4, 4]``, checking K first."""
    check_tensor(w, operand)
    if w.dim() < 1:
        raise InvalidProblem(f"{operand} is a 0-d tensor; it needs a last dimension K to group by 4")
    k = w.shape[-1]
    if k % multiple:
        raise MisalignedOperand(
            f"{operand} has K = shape[-1] = {k}, which is not a multiple of {multiple}; "
            f"the 2:4 format needs K % {multiple} == 0: pad K with zero columns up to "
            f"{-(-k // multiple) * multiple} (or leave this layer dense)"
        )
    return w.reshape(*w.shape[:-1], k // 4, 4)


def _two_positions(keep: torch.Tensor) -> torch.Tensor:
    """For a bool ``[..., 4]`` mask with <= 2 True, the two positions to store, ascending.

    Kept entries come first, then the lowest free indices; a stable sort on
    ``~keep`` gives exactly that order.
    """
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :2]
    return order.sort(dim=-1).values


def _rows(w: torch.Tensor) -> torch.Tensor:
    """``w [..., K]`` as 2-D rows of unit stride (a view where it can be one)."""
    rows = w.reshape(-1, w.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def prune(w: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Zero all but the 2 largest ``|w|`` of each group of 4 along the last dim.

    Ties go to the lower index.  With ``mask`` (bool, same shape, at most 2
    True per group), apply that mask instead.  Returns a new dense tensor of
    ``w``'s shape and dtype.
    """
    groups = _groups(w, "w", 4)
    dtype_info(w.dtype, "w", SPARSE24_DTYPES)
    check_has_data(w, "w", "prune")
    kernels = gpu_kernels(w) if mask is None and w.numel() else None
    if kernels is not None:
        dense = kernels.compress(_rows(w), prune=True, dense=True)
        if dense is not None:  # None: a NaN, named below
            return dense.view(w.shape)
    if mask is None:
        if torch.isnan(w).any():
            raise InvalidProblem(
                "w contains NaN, and magnitude pruning cannot rank NaN; replace the NaNs "
                "(torch.nan_to_num) or pass an explicit mask="
            )
        # Stable descending sort on |w|: equal magnitudes keep index order, so ties
        # go to the lower index, as the format promises.
        top2 = torch.sort(groups.abs().to(torch.float32), dim=-1, descending=True, stable=True).indices[..., :2]
        keep = torch.zeros(groups.shape, dtype=torch.bool, device=w.device).scatter_(-1, top2, True)
    else:
        check_tensor(mask, "mask", shape=w.shape, dtype=torch.bool, device=w.device)
        keep = mask.reshape(groups.shape)
        bad = keep.sum(-1) > 2
        if bad.any():
            raise InvalidProblem(
                f"mask keeps more than 2 of 4 entries in {int(bad.sum())} groups "
                f"(first at flat group {int(bad.flatten().nonzero()[0])}); a 2:4 mask keeps at "
                f"most 2 per group: build it with kernelplan.sparse24.prune(w) != 0"
            )
    return torch.where(keep, groups, torch.zeros((), dtype=w.dtype, device=w.device)).reshape(w.shape)


def is_sparse24(w: torch.Tensor) -> bool:
    """True if every group of 4 along the last dim has at most 2 non-zeros."""
    if not isinstance(w, torch.Tensor) or w.dim() < 1 or w.shape[-1] % 4:
        return False
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4)
    return bool(((groups != 0).sum(-1) <= 2).all())


def compress(w: torch.Tensor, packed: bool = False) -> "Sparse24Weight":
    """Compress a 2:4-sparse ``w [M, K]`` (see :func:`prune`) to values + metadata.

    ``packed``: in the device layout (``layout.py``; K padded to a multiple of 64) where M % 16 == 0, else in the
    public format, as ``Sparse24Linear(layout="auto")`` holds a weight; on the GPU in one pass from ``w``."""
    check_tensor(w, "w")
    if w.dim() != 2:
        raise InvalidProblem(
            f"w has shape {tuple(w.shape)}; compress takes a 2-D weight [M, K]: reshape it to 2-D first"
        )
    dtype_info(w.dtype, "w", SPARSE24_DTYPES)
    groups = _groups(w, "w", COMPRESS_K)
    check_has_data(w, "w", "compress")
    w24 = _gpu_compress(w, False, packed)
    if w24 is not None:  # None: the torch ops, or a group of more than 2, named below
        return w24
    nonzero = groups != 0
    counts = nonzero.sum(-1)
    if (counts > 2).any():
        row, group = (counts > 2).nonzero()[0].tolist()
        raise InvalidProblem(
            f"w is not 2:4 sparse: row {row}, group {group} (columns {4 * group}..{4 * group + 3}) "
            f"has {int(counts[row, group])} non-zeros, more than 2; prune it first with "
            f"kernelplan.sparse24.prune(w)"
        )
    pos = _two_positions(nonzero)  # [M, K/4, 2]
    values = torch.gather(groups, -1, pos).reshape(w.shape[0], w.shape[1] // 2)
    byte = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.int32)  # [M, K/4]
    words = byte[:, 0::2] | (byte[:, 1::2] << 8)
    w24 = Sparse24Weight(values.contiguous(), words.to(torch.int16), _validate=False)
    return w24.packed() if packed and pack_reason(*w.shape) is None else w24


def prune_compress(w: torch.Tensor, packed: bool = False) -> "Sparse24Weight":
    """``compress(prune(w), packed)`` of a 2-D weight, in one pass on the GPU (no pruned dense copy)."""
    if w.dim() == 2 and w.shape[-1] % 8 == 0:
        w24 = _gpu_compress(w, True, packed)
        if w24 is not None:
            return w24
    return compress(prune(w), packed)


def _gpu_compress(w: torch.Tensor, prune: bool, packed: bool) -> "Sparse24Weight | None":
    """The conversion kernels' weight of a 2-D ``w`` (``packed``: in the device layout where its shape allows), or
    None where they do not run (not on the GPU, no data) or refuse ``w`` (the torch ops then name why)."""
    kernels = gpu_kernels(w) if w.numel() else None
    if kernels is None:
        return None
    if packed and pack_reason(*w.shape) is None:
        k = w.shape[1]
        # A K the layout pads: w's zero columns appended (a copy of w, once), which prune and compress to the
        # padding's words and zeros.
        rows = _rows(w) if k == padded_k(k) else torch.nn.functional.pad(w, (0, padded_k(k) - k))
        parts = kernels.compress_tiled(rows, prune=prune)
        return None if parts is None else Sparse24Weight(*parts, k=k, _validate=False)
    parts = kernels.compress(_rows(w), prune=prune)
    return None if parts is None else Sparse24Weight(*parts, _validate=False)


def _metadata_bytes(metadata: torch.Tensor) -> torch.Tensor:
    """``metadata [M, K/8]`` -> ``[M, K/8, 2]`` int32 bytes, low byte first."""
    words = metadata.to(torch.int32)
    return torch.stack((words & 0xFF, (words >> 8) & 0xFF), dim=-1)


def unpack_positions(metadata: torch.Tensor) -> torch.Tensor:
    """``metadata [M, K/8]`` -> ``[M, K/4, 2]`` int64 positions (pos0, pos1) per group."""
    byte = _metadata_bytes(metadata).reshape(metadata.shape[0], -1)
    return torch.stack((byte & 0x3, (byte >> 2) & 0x3), dim=-1).long()


# Backend layouts derived from (values, metadata) tensors, for backends that see tensors
# rather than a Sparse24Weight.  Keyed on the identity of ``values`` (a WeakKeyDictionary
# would compare tensors with ==) and dropped when it is collected; an in-place change of
# either tensor (its version counter moves) rebuilds the layout.  Per weight: whether
# ``values`` is an inference tensor, and its layouts by key.
_DERIVED: dict[int, tuple[bool, dict]] = {}


def forget_derived(values: torch.Tensor) -> None:
    """Drop the layouts derived from ``values`` (rebuilt on the next call that needs them)."""
    _DERIVED.pop(id(values), None)


def output_rows(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, x2, y2)``: y of shape ``[*x.shape[:-1], m]`` allocated, and x and y as 2-D row views."""
    # Sizes as separate ints: new_empty parses them in 2.6 us, a tuple in 4.1 and a torch.Size in 6.1 (CPU CI host).
    if x.dim() == 2:  # no views to make: each costs a microsecond or two of host time
        y = x.new_empty(x.shape[0], m)
        return y, x, y
    y = x.new_empty(*x.shape[:-1], m)
    return y, x.reshape(-1, x.shape[-1]), y.view(-1, m)


def derived_from(values: torch.Tensor, metadata: torch.Tensor, key, build: Callable, *, device_work: bool = True):
    """``build(values, metadata)``, computed once per weight state and cached.

    A build that runs kernels (``device_work``) is refused inside a CUDA graph
    capture: its kernels would only be recorded, and the cache would hold a
    layout that is empty until the graph's first replay.
    """
    entry = _DERIVED.get(id(values))
    if entry is None:
        entry = _DERIVED[id(values)] = (values.is_inference(), {})
        weakref.finalize(values, _DERIVED.pop, id(values), None)
    inference, per_weight = entry
    # Inference tensors count no versions (outside inference mode they are read-only), and reading
    # ``_version`` of one raises: 11 us per call of host time where caught, so it is asked first.
    if inference:
        state = (None, values.data_ptr(), None if metadata.is_inference() else metadata._version,
                 metadata.data_ptr())
    else:
        try:
            state = (values._version, values.data_ptr(), metadata._version, metadata.data_ptr())
        except RuntimeError:  # metadata alone is an inference tensor
            state = (values._version, values.data_ptr(), None, metadata.data_ptr())
    hit = per_weight.get(key)
    if hit is not None and hit[0] == state:
        return hit[1]
    if device_work and values.is_cuda and torch.cuda.is_current_stream_capturing():
        raise InvalidState(
            f"the 2:4 weight's {key} layout (shape {tuple(values.shape)}) would first be built inside a CUDA "
            f"graph capture, where its kernels only record; run the same call once eagerly before capturing (a "
            f"model compiled with mode='reduce-overhead' captures again after its weights move: call it once "
            f"uncompiled after moving or loading them)"
        )
    layout = build(values, metadata)
    per_weight[key] = (state, layout)
    return layout


def _tensors(layout, depth: int = 0):
    """The tensors a derived layout holds: itself, in a tuple or list, or as an attribute of a layout object."""
    if isinstance(layout, torch.Tensor):
        yield layout
    elif isinstance(layout, (tuple, list)):
        for item in layout:
            yield from _tensors(item, depth)
    elif depth < 2 and hasattr(layout, "__dict__"):
        for item in vars(layout).values():
            yield from _tensors(item, depth + 1)


def _count_derived(values: torch.Tensor, prefix: str, seen: set, out: dict, depth: int = 0) -> None:
    """Add the bytes of the layouts derived from ``values`` to ``out``, and of those derived from them in turn.

    A weight held in the device layout may derive the public format for a
    backend that reads it (``gemm.public_parts``), and that copy its own layouts.
    """
    entry = _DERIVED.get(id(values))
    for key, (_, layout) in (entry[1].items() if entry else ()):
        for t in _tensors(layout):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[prefix + str(key)] = out.get(prefix + str(key), 0) + storage.nbytes()
            if depth < 2 and id(t) in _DERIVED:
                _count_derived(t, f"{prefix}{key} > ", seen, out, depth + 1)


class Sparse24Weight:
    """A 2:4-compressed weight of logical shape ``[M, K]``: ``values`` and ``metadata``.

    ``values`` may be an ``nn.Parameter`` (training updates it; the mask, held
    in ``metadata``, stays fixed).  Constructing one from user tensors checks
    the metadata bits, since a bad word would otherwise scatter out of place.
    """

    __slots__ = ("values", "metadata", "k")

    def __init__(self, values: torch.Tensor, metadata: torch.Tensor, *, k: int | None = None,
                 _validate: bool = True):
        # k: the logical K of a weight held in the device layout with K padded (layout.padded_k); None, the
        # columns the tensors hold.  The public format holds K exactly.
        held = weight_shape(values)[1] if isinstance(values, torch.Tensor) and values.dim() in (2, 3) else None
        if k is not None and held is not None and k != held and (layout_of(values) == PUBLIC or not k_fits(k, held)):
            raise InvalidProblem(f"k = {k}, but the {layout_of(values)} values hold {held} columns: a weight of K "
                                 f"columns holds K, or in the device layout K rounded up to 64 (K % 8 == 0); pass "
                                 f"the weight's own K")
        if _validate:
            if layout_of(values) == SP_LAYOUT:
                held = check_layout(values, metadata)[1]
                full = unpack(values, metadata)
                _validate_compressed(*full)
                if k is not None and k < held and bool((full[0][:, k // 2:] != 0).any()):
                    raise InvalidProblem(f"k = {k}, but the values hold non-zeros past column {k}: the padding of a "
                                         f"weight of K = {k} is zeros; pass the weight's own K ({held}?)")
            else:
                _validate_compressed(values, metadata)
        self.values = values
        self.metadata = metadata
        self.k = None if k is None or k == held else k

    @property
    def shape(self) -> torch.Size:
        m, held = weight_shape(self.values)
        return torch.Size((m, held if self.k is None else self.k))

    @property
    def layout(self) -> str:
        """``"public"`` (values [M, K/2], metadata [M, K/8]) or ``"sp tiled"``, the device layout (``layout.py``)."""
        return layout_of(self.values)

    def public(self) -> "Sparse24Weight":
        """This weight in the public format: itself, or its device layout unpacked (new tensors)."""
        if self.layout == PUBLIC:
            return self
        return Sparse24Weight(*unpack(self.values, self.metadata, self.k), _validate=False)

    def packed(self) -> "Sparse24Weight":
        """This weight in the device layout (``layout.py``): itself, or new tensors, K padded to a multiple of 64;
        M % 16 must be 0."""
        if self.layout == SP_LAYOUT:
            return self
        return Sparse24Weight(*pack(self.values, self.metadata), k=self.shape[1], _validate=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def positions(self) -> torch.Tensor:
        """Column index in ``W`` of every stored value of the public format: ``[M, K/2]`` int64."""
        if self.layout != PUBLIC:
            return self.public().positions()
        pos = unpack_positions(self.metadata)  # [M, K/4, 2]
        base = 4 * torch.arange(pos.shape[1], device=pos.device).view(1, -1, 1)
        return (pos + base).reshape(self.values.shape)

    def mask(self) -> torch.Tensor:
        """Bool ``[M, K]``: True where a value is stored (zeros stored as fillers count)."""
        m, k = self.shape
        return torch.zeros((m, k), dtype=torch.bool, device=self.device).scatter_(1, self.positions(), True)

    def decompress(self, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The dense ``W [M, K]``; differentiable in ``values``.

        ``positions`` (from :meth:`positions`) saves unpacking the metadata again.
        """
        if self.layout != PUBLIC:
            return self.public().decompress(positions)
        m, k = self.shape
        dense = torch.zeros((m, k), dtype=self.dtype, device=self.device)
        return dense.scatter(1, self.positions() if positions is None else positions, self.values)

    def to(self, *args, **kwargs) -> "Sparse24Weight":
        """Move/convert the values; metadata only moves (it is not a float tensor)."""
        values = self.values.to(*args, **kwargs)
        return Sparse24Weight(values, self.metadata.to(values.device), k=self.k, _validate=False)

    def derived(self, key, build: Callable[["Sparse24Weight"], object]):
        """A backend layout built from this weight once, and rebuilt after values change.

        ``key`` names the layout (for example ``("cusparselt", device)``).
        The values' version counter is part of the cache key, so an optimizer
        step or an in-place edit invalidates the layout.  The cache is the one
        backends use (``derived_from``), kept with the values tensor, so a new
        ``Sparse24Weight`` over the same tensors (``Sparse24Linear.weight24``
        builds one per call) finds the layout already built.
        """
        return derived_from(self.values, self.metadata, key, lambda values, metadata: build(self))

    def derived_bytes(self) -> dict[str, int]:
        """Bytes of the backend layouts built from this weight so far, by layout; each storage counted once.

        What the weight holds beyond ``values`` and ``metadata``: a backend's
        copy (a tiled layout, cuSPARSELt's buffer, the dense weight) lives as
        long as the values tensor.  Host objects (plans, launches) are not counted.
        """
        seen = {self.values.untyped_storage().data_ptr(), self.metadata.untyped_storage().data_ptr()}
        out: dict[str, int] = {}
        _count_derived(self.values, "", seen, out)
        return out

    def __repr__(self) -> str:
        m, k = self.shape
        padded = "" if self.k is None else f", held padded to {weight_shape(self.values)[1]} columns"
        return f"Sparse24Weight(shape=({m}, {k}), dtype={self.dtype}, device={self.device}{padded})"


def _validate_compressed(values: torch.Tensor, metadata: torch.Tensor) -> None:
    check_shapes(values, metadata)
    bad = bad_words(metadata)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise InvalidProblem(
            f"metadata[{row}, {col}] = {int(metadata[row, col]) & 0xFFFF:#06x} is not a valid 2:4 "
            f"word: each byte must hold pos0 in bits 0-1 and pos1 > pos0 in bits 2-3, bits 4-7 "
            f"clear; the file or tensor is corrupt: recompress the weight with compress(w)"
        )


def bad_words(metadata: torch.Tensor) -> torch.Tensor:
    """Where public-format ``metadata`` holds a word that is not 2:4 (bool, its shape), computed on its device without
    waiting for it: a loader checks each weight as it comes and reads the flags once at the end."""
    byte = _metadata_bytes(metadata)
    return (metadata < 0) | ((byte & 0xF0) != 0).any(-1) | ((byte & 0x3) >= (byte >> 2)).any(-1)


def check_shapes(values: torch.Tensor, metadata: torch.Tensor) -> None:
    """The public format's dtypes, devices and shapes (``values [M, K/2]``, ``metadata [M, K/8]`` int16), on the
    host."""
    check_tensor(values, "values")
    check_tensor(metadata, "metadata", dtype=torch.int16, device=values.device)
    dtype_info(values.dtype, "values", SPARSE24_DTYPES)
    if values.dim() != 2 or metadata.dim() != 2:
        raise InvalidProblem(
            f"values has shape {tuple(values.shape)} and metadata {tuple(metadata.shape)}; both "
            f"must be 2-D: values [M, K/2], metadata [M, K/8]"
        )
    m, half = values.shape
    if half % 4 or tuple(metadata.shape) != (m, half // 4):
        raise InvalidProblem(
            f"values has shape {tuple(values.shape)} and metadata {tuple(metadata.shape)}; "
            f"for a weight [M, K] they must be [M, K/2] and [M, K/8] with K % 8 == 0: "
            f"build them with kernelplan.sparse24.compress(w)"
        )
