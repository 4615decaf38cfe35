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
ones 2-D.  It needs M % 16 == 0 and K % 64 == 0; a weight of other shapes stays
in the public format (``pack_reason``).  Every step is a view, a permute or an
elementwise op, so the conversions run wherever the tensors are, on the GPU
for a weight there.
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


def k_reason(k: int) -> str | None:
    """Why the device layout, and so every 2:4 GPU kernel (Triton's too), cannot take K columns, or None."""
    return f"K = {k} is not a multiple of {TILE_K}, the layout's column step" if k % TILE_K else None


def pack_reason(m: int, k: int) -> str | None:
    """Why a weight ``[M, K]`` cannot be held in the device layout, or None."""
    if m % TILE_M:
        return f"M = {m} is not a multiple of {TILE_M}, the layout's row tile"
    return k_reason(k)


def packed_shapes(m: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (m // TILE_M, k // TILE_K, 512), (m // TILE_M, k // TILE_K, 32)


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
    """Public ``values [M, K/2]`` -> the device layout's ``[M/16, K/64, 512]``; differentiable (a permutation)."""
    m, k = _packable(values)
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
    words = metadata.to(torch.int64)
    groups = torch.stack((words & 0xFF, (words >> 8) & 0xFF), dim=-1).reshape(m, k // 16, 4)  # a byte per group
    quads = groups[..., 0] | groups[..., 1] << 4 | groups[..., 2] << 8 | groups[..., 3] << 12  # [M, K/16]
    quads = quads.view(m // 16, 2, 8, k // 64, 4)  # [tile, h, g, step, t]
    lanes = (quads[:, 0] | quads[:, 1] << 16).permute(0, 2, 1, 3)  # [tile, step, g, t]
    lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)  # the same 32 bits
    return lanes.reshape(packed_shapes(m, k)[1])


def pack(values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Public ``(values [M, K/2], metadata [M, K/8] int16)`` -> the device layout; new tensors, same device.

    On the GPU in one pass (``kernels/sparse24_convert.py``), not differentiable
    there; ``pack_values`` is.
    """
    kernels = _kernels(values)
    if kernels is not None:
        _packable(values)
        return kernels.pack(values.detach().contiguous(), metadata.contiguous())
    return pack_values(values), pack_metadata(metadata)


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
    m, k = part.shape[0], per_row * part.shape[1]
    why = pack_reason(m, k)
    if why is not None:
        raise InvalidProblem(f"the weight [{m}, {k}] cannot be held in the {SP_LAYOUT} layout: {why}; "
                             f"keep it in the public format (Sparse24Linear(layout='public'))")
    return m, k


def unpack_values(values: torch.Tensor) -> torch.Tensor:
    """The device layout's values -> public ``[M, K/2]``; differentiable (a permutation)."""
    m, k = weight_shape(values)
    return values.reshape(m // 16, k // 64, 2, 2, 2, 8, 4, 2).permute(0, 4, 5, 1, 2, 3, 6, 7).reshape(m, k // 2)


def unpack_metadata(metadata: torch.Tensor) -> torch.Tensor:
    """The device layout's words -> public ``metadata [M, K/8]`` int16 (``pack_metadata`` run backwards)."""
    m, k = TILE_M * metadata.shape[0], TILE_K * metadata.shape[1]
    lanes = metadata.reshape(m // 16, k // 64, 8, 4).to(torch.int64)
    quads = torch.stack((lanes & 0xFFFF, (lanes >> 16) & 0xFFFF), dim=1)  # [tile, h, step, g, t]
    quads = quads.permute(0, 1, 3, 2, 4).reshape(m, k // 16)
    groups = torch.stack([(quads >> s) & 0xF for s in (0, 4, 8, 12)], dim=-1).reshape(m, k // 8, 2)
    return (groups[..., 0] | groups[..., 1] << 8).to(torch.int16)


def unpack(values: torch.Tensor, metadata: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The device layout -> public ``(values [M, K/2], metadata [M, K/8] int16)``; new tensors, same device.

    On the GPU in one pass, not differentiable there; ``unpack_values`` is.
    """
    kernels = _kernels(values)
    if kernels is not None:
        return kernels.unpack(values.detach().contiguous(), metadata.contiguous())
    return unpack_values(values), unpack_metadata(metadata)
