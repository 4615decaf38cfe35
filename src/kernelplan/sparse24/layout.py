"""The one device layout of a 2:4 weight, ``sp tiled``, and its conversions to and from the public format.

The public format (``format.py``) keeps a byte per group of 4 for the two
positions; the sparse tensor cores read 4 bits.  The device layout holds the
same values and those 4-bit pairs, in the order the ``mma.sp`` and
``wgmma.sp`` kernels read them: 0.5625x of the dense bytes at 16-bit weights, where the
public format takes 0.625x.

* ``values [M/16, K/64, 512]``, the weight's dtype: per 16-row tile and
  64-column step, 8 core matrices of 8 rows by 4 groups (128 bytes at 16-bit
  weights, each row's 4 kept pairs contiguous).  Row ``16 i + 8 h + g``, group
  ``16 s + 8 u + 4 j + t``, kept value ``e`` goes to ``[i, s, (u, j, h, g, t,
  e)]``.  That is the K-major, unswizzled core-matrix order in which
  ``wgmma.sp`` reads its A operand from shared memory (k32 ``u``'s matrices
  ``j`` along K, ``h`` along M, the copy engine putting 64 rows' matrices next
  to each other: ``kernels/cuda/sparse24_ring.cuh``), and the order in which
  ``ldmatrix.x4`` at 16 bytes a lane gives lane ``4 g + t`` its ``mma.sp`` A
  fragment of k32 ``u``: (row g, group t), (row g + 8, group t), (row g, group
  t + 4), (row g + 8, group t + 4), two values each (``kernels/cuda/
  sparse24_sp.cu``).
* ``metadata [M/16, K/64, 32]`` int32: lane ``4 g + t``'s word.  A row's 16
  columns ``16 t .. 16 t + 15`` of the step are 16 bits, 4 per group (the
  format's ``pos0 | pos1 << 2``), its first group lowest; row ``g`` in the
  low half word, row ``g + 8`` in the high.

A layout is told apart by its tensors: device-layout values are 3-D, public
ones 2-D.  It needs M % 16 == 0; a weight of other rows stays in the public
format (``pack_reason``).  A K that is not a multiple of 64 (SigLIP-so400m's
MLP, K = 4304) is padded to the next one, ``padded_k``, with zero columns kept
at positions 0 and 1: the tensors hold ``K'`` columns, and the logical K is
the holder's (``Sparse24Weight.k``, ``Sparse24Linear.in_features``) or x's at
a call.  The kernels read x's K columns and zeros past them
(docs/design/0083).  Every step is a view, a permute, a pad or an elementwise
op, so the conversions run wherever the tensors are, on the GPU for a weight
there.
"""

from __future__ import annotations

import torch

from .._checks import check_tensor, warn_once
from ..errors import InvalidProblem
from ..kernels import have_triton

PUBLIC = "public"
SP_LAYOUT = "sp tiled"
TILE_M, TILE_K = 16, 64


def layout_of(values: torch.Tensor) -> str:
    return SP_LAYOUT if values.dim() == 3 else PUBLIC


def weight_shape(values: torch.Tensor) -> tuple[int, int]:
    """``(M, K)`` of the weight whose values these are, in either layout."""
    if values.dim() == 3:
        return TILE_M * values.shape[0], TILE_K * values.shape[1]
    return values.shape[0], 2 * values.shape[1]


def padded_k(k: int) -> int:
    """The columns the device layout holds for a weight of K columns: K rounded up to the layout's 64."""
    return -(-k // TILE_K) * TILE_K


def pack_reason(m: int, k: int) -> str | None:
    """Why a weight ``[M, K]`` cannot be held in the device layout, or None."""
    if m % TILE_M:
        return f"M = {m} is not a multiple of {TILE_M}, the layout's row tile"
    if k % 8:
        return f"K = {k} is not a multiple of 8, the 2:4 format's"
    return None


def k_fits(k: int, held: int) -> bool:
    """Whether x of ``k`` columns is read by a weight whose tensors hold ``held``: K itself, or padded to it."""
    return k == held or k % 8 == 0 and padded_k(k) == held


def packed_shapes(m: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    steps = -(-k // TILE_K)
    return (m // TILE_M, steps, 512), (m // TILE_M, steps, 32)


def check_layout(values: torch.Tensor, metadata: torch.Tensor) -> tuple[int, int]:
    """``(M, K)`` of a weight's parts in either layout, after checking that they match each other."""
    check_tensor(values, "values")
    if values.dim() == 3 and values.shape[2] == 512:
        m, k = weight_shape(values)
        check_tensor(metadata, "metadata", shape=packed_shapes(m, k)[1], dtype=torch.int32, device=values.device)
    elif values.dim() == 2:
        m, k = weight_shape(values)
        check_tensor(metadata, "metadata", shape=(m, k // 8), dtype=torch.int16, device=values.device)
    else:
        raise InvalidProblem(
            f"values has shape {tuple(values.shape)}; a 2:4 weight's values are [M, K/2] (the public format) "
            f"or [M/16, K/64, 512] (the {SP_LAYOUT} device layout): build them with kernelplan.sparse24.compress(w)"
        )
    return m, k


def pack_values(values: torch.Tensor) -> torch.Tensor:
    """Public ``values [M, K/2]`` -> the device layout's ``[M/16, K'/64, 512]``; differentiable (a pad and a
    permutation)."""
    m, k = _packable(values)
    values, k = _padded(values, k, 0), padded_k(k)
    tv = values.reshape(m // 16, 2, 8, k // 64, 2, 2, 4, 2).permute(0, 3, 4, 5, 1, 2, 6, 7)  # (i, s, u, j, h, g, t, e)
    return tv.reshape(packed_shapes(m, k)[0])


def pack_metadata(metadata: torch.Tensor) -> torch.Tensor:
    """Public ``metadata [M, K/8]`` int16 -> the device layout's ``[M/16, K/64, 32]`` int32 words.

    The format's byte per group is the hardware's 4-bit pair: four groups'
    bytes make a row's 16 columns, two rows' half words a lane's word.
    Integer arithmetic only, no dtype views: Inductor cannot lower a view of
    int16 as bytes in a compiled backward (torch 2.11).
    """
    m, k = _packable(metadata, 8)
    metadata, k = _padded(metadata, k, PAD_WORD), padded_k(k)
    words = metadata.to(torch.int64)
    groups = torch.stack((words & 0xFF, (words >> 8) & 0xFF), dim=-1).reshape(m, k // 16, 4)  # a byte per group
    quads = groups[..., 0] | groups[..., 1] << 4 | groups[..., 2] << 8 | groups[..., 3] << 12  # [M, K/16]
    quads = quads.view(m // 16, 2, 8, k // 64, 4)  # [tile, h, g, step, t]
    lanes = (quads[:, 0] | quads[:, 1] << 16).permute(0, 2, 1, 3)  # [tile, step, g, t]
    lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)  # the same 32 bits
    return lanes.reshape(packed_shapes(m, k)[1])


def pack(values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Public ``(values [M, K/2], metadata [M, K/8] int16)`` -> the device layout, K padded to ``padded_k``; new
    tensors, same device.

    On the GPU in one pass (``kernels/sparse24_convert.py``) where K needs no
    pad, not differentiable there; ``pack_values`` is.
    """
    kernels = _kernels(values)
    if kernels is not None:
        m, k = _packable(values)
        return kernels.pack(_padded(values.detach(), k, 0).contiguous(),
                            _padded(metadata, k, PAD_WORD).contiguous())
    return pack_values(values), pack_metadata(metadata)


# A padded group's word half: positions 0 and 1 (the format's byte 0b0100), the two values zeros.
PAD_WORD = 0x0404


def _padded(part: torch.Tensor, k: int, value: int) -> torch.Tensor:
    """A public part (``values [M, K/2]`` or ``metadata [M, K/8]``) with the columns of ``padded_k(k) - k`` more
    weight columns appended: ``value`` (zeros; the padding word), itself where K needs none."""
    more = (padded_k(k) - k) * part.shape[1] // k
    return torch.nn.functional.pad(part, (0, more), value=value) if more else part


def gpu_kernels(t: torch.Tensor):
    """The Triton conversion kernels (``kernels/sparse24_convert.py``) where they convert ``t``, else None.

    A CUDA tensor without Triton installed converts by the torch ops, which give
    the same bits in many passes: a one-time warning says so.
    """
    if not t.is_cuda or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None  # traced (FakeTensor, FunctionalTensor, a compiled backward): no pointers, the torch ops
    if not have_triton():
        warn_once("triton is not installed: 2:4 weights are pruned, compressed and laid out on the GPU by torch "
                   "ops, in many passes (pip install 'kernelplan[gpu]' for the one-pass kernels)")
        return None
    from ..kernels import sparse24_convert

    return sparse24_convert


def _kernels(values: torch.Tensor):
    """The GPU kernels where they convert ``values``; not where autograd must follow the conversion."""
    if not values.numel() or (values.requires_grad and torch.is_grad_enabled()):
        return None
    return gpu_kernels(values)


def _packable(part: torch.Tensor, per_row: int = 2) -> tuple[int, int]:
    """``(M, K)`` of a public part (``per_row`` weight columns a column of it), checked to pack."""
    m, k = part.shape[0], per_row * part.shape[1]
    why = pack_reason(m, k)
    if why is not None:
        raise InvalidProblem(f"the weight [{m}, {k}] cannot be held in the {SP_LAYOUT} layout: {why}; "
                             f"keep it in the public format (Sparse24Linear(layout='public'))")
    return m, k


def unpack_values(values: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The device layout's values -> public ``[M, K/2]``, K the logical ``k`` (the held columns where None: a
    padded weight's first ``k``); differentiable (a permutation and a slice)."""
    m, held = weight_shape(values)
    public = values.reshape(m // 16, held // 64, 2, 2, 2, 8, 4, 2).permute(0, 4, 5, 1, 2, 3, 6, 7)
    return _cut(public.reshape(m, held // 2), held, k)


def _cut(part: torch.Tensor, held: int, k: int | None) -> torch.Tensor:
    """A public part of ``held`` weight columns cut to the first ``k`` (a view; itself where ``k`` is None or all)."""
    if k is None or k == held:
        return part
    if not k_fits(k, held):
        raise InvalidProblem(f"k = {k}: a weight whose device layout holds {held} columns has K of {held - 63} to "
                             f"{held}, a multiple of 8; pass its own in_features")
    return part[:, :k * part.shape[1] // held]


def unpack_metadata(metadata: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The device layout's words -> public ``metadata [M, K/8]`` int16 (``pack_metadata`` run backwards), K the
    logical ``k`` as ``unpack_values``'s."""
    public = _unpack_words(metadata)
    return _cut(public, 8 * public.shape[1], k)


def _unpack_words(metadata: torch.Tensor) -> torch.Tensor:
    m, k = TILE_M * metadata.shape[0], TILE_K * metadata.shape[1]
    lanes = metadata.reshape(m // 16, k // 64, 8, 4).to(torch.int64)
    quads = torch.stack((lanes & 0xFFFF, (lanes >> 16) & 0xFFFF), dim=1)  # [tile, h, step, g, t]
    quads = quads.permute(0, 1, 3, 2, 4).reshape(m, k // 16)
    groups = torch.stack([(quads >> s) & 0xF for s in (0, 4, 8, 12)], dim=-1).reshape(m, k // 8, 2)
    return (groups[..., 0] | groups[..., 1] << 8).to(torch.int16)


def unpack(values: torch.Tensor, metadata: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The device layout -> public ``(values [M, K/2], metadata [M, K/8] int16)``, K the logical ``k`` (all the
    held columns where None); new contiguous tensors, same device.

    On the GPU in one pass, not differentiable there; ``unpack_values`` is.
    """
    kernels = _kernels(values)
    if kernels is not None:
        held = weight_shape(values)[1]
        public = kernels.unpack(values.detach().contiguous(), metadata.contiguous())
        return tuple(_cut(part, held, k).contiguous() for part in public)
    return unpack_values(values, k).contiguous(), unpack_metadata(metadata, k).contiguous()
