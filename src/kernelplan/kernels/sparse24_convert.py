"""Triton kernels that convert 2:4 weights on the GPU: prune, compress, and the device layout's pack and unpack.

Written as torch ops (``sparse24/format.py``, ``sparse24/layout.py``) the same
steps ran on an H100 (bf16, 28672x8192) at: ``compress`` 101 ms and ``prune``
165 ms (a sort per group of 4), ``pack`` and ``unpack`` at 0.30x of the copy
bandwidth (8-D permutes of 4-byte pairs).  Here each is one pass over the
bytes (``bench/sparse24_convert.py``).

Everything works on the weights' bits, viewed as integers of their width:
``|w|`` ranks as ``bits & 0x7f..f`` for IEEE floats (NaN above infinity),
exactly as torch's float32 ``abs`` does for 16- and 32-bit weights, and no
float arithmetic is done (the Triton interpreter gets bf16 arithmetic wrong).
64-bit weights, whose float32 ranks may tie where their bits do not, stay
on the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import Launcher

# Integer view, |bits| mask and the bits of +inf, by element width in bytes.
_BITS = {2: (torch.int16, 0x7FFF, 0x7C00), 4: (torch.int32, 0x7FFFFFFF, 0x7F800000)}
_INF16 = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _flag(device) -> torch.Tensor:
    """A zeroed int32 that a conversion kernel sets where it refuses a group; one read of it waits for the kernel."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _int_view(t: torch.Tensor):
    ty, absmask, inf = _BITS[t.element_size()]
    return t.view(ty), absmask, _INF16.get(t.dtype, inf)


@triton.jit
def _keep24(a0, a1, a2, a3, PRUNE: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr):
    """Which of a group's 4 bit patterns are kept, and whether the group is refused.

    ``PRUNE``: the 2 largest ``|w|`` (refused: NaN); else the non-zeros, ranked first (-0.0 is zero), with the
    lowest zeros as fillers (refused: more than 2).  Ties go to the lower index, as prune's stable sort."""
    m0, m1, m2, m3 = a0 & ABS, a1 & ABS, a2 & ABS, a3 & ABS
    if PRUNE:  # rank by |w|, NaN refused
        s0, s1, s2, s3 = m0, m1, m2, m3
        bad = (m0 > INF) | (m1 > INF) | (m2 > INF) | (m3 > INF)
    else:  # rank non-zeros first; more than 2 refused
        s0, s1, s2, s3 = (m0 != 0).to(tl.int32), (m1 != 0).to(tl.int32), (m2 != 0).to(tl.int32), (m3 != 0).to(tl.int32)
        bad = s0 + s1 + s2 + s3 > 2
    # Kept: fewer than 2 rank above.
    k0 = (s1 > s0).to(tl.int32) + (s2 > s0).to(tl.int32) + (s3 > s0).to(tl.int32) < 2
    k1 = (s0 >= s1).to(tl.int32) + (s2 > s1).to(tl.int32) + (s3 > s1).to(tl.int32) < 2
    k2 = (s0 >= s2).to(tl.int32) + (s1 >= s2).to(tl.int32) + (s3 > s2).to(tl.int32) < 2
    k3 = (s0 >= s3).to(tl.int32) + (s1 >= s3).to(tl.int32) + (s2 >= s3).to(tl.int32) < 2
    return k0, k1, k2, k3, bad


@triton.jit
def _split4(a, SHAPE0: tl.constexpr, SHAPE1: tl.constexpr):
    """``a [SHAPE0, 4 SHAPE1]``, groups of 4 along its rows -> the groups' 4 entries, each ``[SHAPE0, SHAPE1]``."""
    even, odd = tl.split(tl.reshape(a, (SHAPE0, SHAPE1, 2, 2)))  # columns 4g + {0, 2} and 4g + {1, 3}
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def _kept_pair(a0, a1, a2, a3, k0, k1, k2, k3):
    """The kept values (v0, v1) and their positions' 4 bits, ``pos0 | pos1 << 2``, of each group."""
    p0 = tl.where(k0, 0, tl.where(k1, 1, 2))
    p1 = tl.where(k3, 3, tl.where(k2, 2, 1))
    v0 = tl.where(k0, a0, tl.where(k1, a1, a2))
    v1 = tl.where(k3, a3, tl.where(k2, a2, a1))
    return v0, v1, p0 | (p1 << 2)


@triton.jit
def _key16(a, LOWER: tl.constexpr, PRUNE: tl.constexpr):
    """An entry's key (``_pick16``); ``LOWER`` is 3 - its index in the group."""
    if PRUNE:
        return ((a.to(tl.int32) & 0x7FFF) << 16) | (LOWER << 14) | ((a.to(tl.int32) >> 2) & 0x2000)
    return tl.where((a & 0x7FFF) != 0, 1 << 18, 0) | (LOWER << 16) | (a.to(tl.int32) & 0xFFFF)


@triton.jit
def _pick16(a0, a1, a2, a3, PRUNE: tl.constexpr, INF: tl.constexpr):
    """``_keep24`` then ``_kept_pair`` for 16-bit weights (int16 bits), in about half the instructions: the kept
    values (v0, v1) as int32, their positions' 4 bits, and whether the group is refused.

    Each entry becomes a key that ranks as prune ranks it and carries the entry, so that the two largest keys (a
    network of 6 min / max) are the kept entries: pruning, |w|'s 15 bits in bits 16-30, 3 - its index in bits 14-15
    (ties to the lower index), its sign in bit 13; compressing, 1 where it is non-zero in bit 18, 3 - its index in
    bits 16-17, its 16 bits below."""
    IB: tl.constexpr = 14 if PRUNE else 16  # where the index's 2 bits sit
    k0, k1, k2, k3 = _key16(a0, 3, PRUNE), _key16(a1, 2, PRUNE), _key16(a2, 1, PRUNE), _key16(a3, 0, PRUNE)
    hi01, lo01, hi23, lo23 = tl.maximum(k0, k1), tl.minimum(k0, k1), tl.maximum(k2, k3), tl.minimum(k2, k3)
    top = tl.maximum(hi01, hi23)
    inner, outer = tl.minimum(hi01, hi23), tl.maximum(lo01, lo23)
    second = tl.maximum(inner, outer)
    if PRUNE:
        bad = (top >> 16) > INF  # a NaN ranks above every number
        val_a = (top >> 16) | ((top & 0x2000) << 2)
        val_b = (second >> 16) | ((second & 0x2000) << 2)
    else:
        bad = tl.minimum(inner, outer) >= (1 << 18)  # a third non-zero
        val_a, val_b = top & 0xFFFF, second & 0xFFFF
    i_a, i_b = 3 - ((top >> IB) & 3), 3 - ((second >> IB) & 3)
    first = i_a < i_b
    v0, v1 = tl.where(first, val_a, val_b), tl.where(first, val_b, val_a)
    return v0, v1, tl.minimum(i_a, i_b) | (tl.maximum(i_a, i_b) << 2), bad


@triton.jit
def _choose(a0, a1, a2, a3, PRUNE: tl.constexpr, ABS: tl.constexpr, INF: tl.constexpr, WIDE: tl.constexpr):
    """Each group's kept values (v0, v1, in the weights' integer type), their positions' 4 bits, and whether the group
    is refused: ``_pick16`` for 16-bit weights, ``_keep24`` then ``_kept_pair`` for 32-bit ones (``WIDE``)."""
    if WIDE:
        k0, k1, k2, k3, bad = _keep24(a0, a1, a2, a3, PRUNE, ABS, INF)
        v0, v1, nib = _kept_pair(a0, a1, a2, a3, k0, k1, k2, k3)
    else:
        v0, v1, nib, bad = _pick16(a0, a1, a2, a3, PRUNE, INF)
        v0, v1 = v0.to(a0.dtype), v1.to(a0.dtype)
    return v0, v1, nib, bad


@triton.jit
def _compress24(w_ptr, v_ptr, m_ptr, d_ptr, bad_ptr, M, K, stride_w, PRUNE: tl.constexpr, DENSE: tl.constexpr,
                ABS: tl.constexpr, INF: tl.constexpr, WIDE: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr):
    """A [BM, 4 BG] block of w: the 2 kept of each group of 4, as values + format words (or masked dense)."""
    pid_m, pid_g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_g * BG * 4 + tl.arange(0, BG * 4)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    a = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=ok, other=0)
    a0, a1, a2, a3 = _split4(a, BM, BG)
    v0, v1, nib, bad = _choose(a0, a1, a2, a3, PRUNE, ABS, INF, WIDE)
    tl.store(bad_ptr + tl.zeros_like(nib), 1, mask=bad)  # one flag; racing writers write alike
    if DENSE:
        zero = tl.zeros_like(a0)
        p0, p1 = nib & 3, nib >> 2
        kept = tl.join(tl.join(tl.where(p0 == 0, a0, zero), tl.where((p0 == 2) | (p1 == 2), a2, zero)),
                       tl.join(tl.where((p0 == 1) | (p1 == 1), a1, zero), tl.where(p1 == 3, a3, zero)))
        tl.store(d_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], tl.reshape(kept, (BM, BG * 4)), mask=ok)
    else:
        vcols = pid_g * BG * 2 + tl.arange(0, BG * 2)
        tl.store(v_ptr + rows[:, None].to(tl.int64) * (K // 2) + vcols[None, :], tl.reshape(tl.join(v0, v1), (BM, BG * 2)),
                 mask=(rows[:, None] < M) & (vcols[None, :] < K // 2))
        lo, hi = tl.split(tl.reshape(nib, (BM, BG // 2, 2)))  # a format word is two groups' bytes
        wcols = pid_g * (BG // 2) + tl.arange(0, BG // 2)
        tl.store(m_ptr + rows[:, None].to(tl.int64) * (K // 8) + wcols[None, :], (lo | (hi << 8)).to(tl.int16),
                 mask=(rows[:, None] < M) & (wcols[None, :] < K // 8))


@triton.jit
def _compress24_tiled(w_ptr, tv_ptr, tm_ptr, bad_ptr, K, stride_w, PRUNE: tl.constexpr, ABS: tl.constexpr,
                      INF: tl.constexpr, WIDE: tl.constexpr, STEPS: tl.constexpr):
    """One 16-row tile of w, STEPS 64-column steps, straight into the device layout (sparse24/layout.py).

    The groups are taken in the layout's pair order d = (((u * 2 + j) * 2 + h) * 8 + g) * 4 + t (row 16 i + 8 h + g,
    group 16 s + 8 u + 4 j + t), two at a time (t = 2 t2 + t1: 8 contiguous columns, one 16-byte load of a 16-bit
    weight), so the kept pairs are stored as they come; lane 4 g + 2 u + j's metadata word is its 4 groups t of rows
    g (low half) and g + 8 (high half), 4 bits each, so byte 2 h + t2 of it is the two groups a thread holds.

    Why two groups a thread and byte stores of the metadata: the kernel is bound by its instructions (2.3-2.6 TB/s
    on an H100 and an H200 alike, sparse24-convert-blocks-*.json), and assembling each word from 8 threads' groups
    took as many of them as choosing the kept pairs (docs/design/0028)."""
    i, sb = tl.program_id(0), tl.program_id(1)
    nsteps = K // 64
    s = sb * STEPS + tl.arange(0, STEPS)[:, None]  # [STEPS, 1]
    q = tl.arange(0, 128)[None, :]  # two groups: d = 2 q + t1
    t2, g, h, uj = q % 2, (q // 2) % 8, (q // 16) % 2, q // 32
    row = (16 * i + 8 * h + g).to(tl.int64)
    col = 64 * s + 16 * uj + 8 * t2  # the two groups' first column: uj = 2 u + j, 16 columns each
    live = s < nsteps  # [STEPS, 1]
    e = tl.arange(0, 8)[None, None, :]
    a = tl.load(w_ptr + (row * stride_w + col)[:, :, None] + e, mask=live[:, :, None], other=0)  # [STEPS, 128, 8]
    # Column e = 4 t1 + c of the two groups: the c of each, for t1 = 0 and 1.
    c_even, c_odd = tl.split(tl.reshape(a, (STEPS, 128, 2, 2, 2)))  # c = 0, 2 | 1, 3, each [.., t1, c // 2]
    a0, a2 = tl.split(c_even)
    a1, a3 = tl.split(c_odd)
    a0l, a0h = tl.split(a0)
    a1l, a1h = tl.split(a1)
    a2l, a2h = tl.split(a2)
    a3l, a3h = tl.split(a3)
    v0l, v1l, nib_l, bad_l = _choose(a0l, a1l, a2l, a3l, PRUNE, ABS, INF, WIDE)
    v0h, v1h, nib_h, bad_h = _choose(a0h, a1h, a2h, a3h, PRUNE, ABS, INF, WIDE)
    # One flag: racing writers write alike, and no reduction across the program is needed.
    tl.store(bad_ptr + tl.zeros_like(nib_l), 1, mask=(bad_l | bad_h) & live)
    tile_step = (i * nsteps + s).to(tl.int64)  # [STEPS, 1]
    pairs = tl.join(tl.join(v0l, v0h), tl.join(v1l, v1h))  # [STEPS, 128, t1, value]: d's pairs in order
    tl.store(tv_ptr + tile_step * 512 + tl.arange(0, 512)[None, :], tl.reshape(pairs, (STEPS, 512)), mask=live)
    byte = (nib_l | (nib_h << 4)).to(tl.int8)
    tl.store(tm_ptr + (tile_step * 32 + 4 * g + uj) * 4 + 2 * h + t2, byte, mask=live)


# Launched through kernels.Launcher: compiled once per specialization (on the weight's device, in kernelplan's Triton
# cache scope), then launched with no re-binding.  Before, each call went through Triton's JIT call inside the cache
# scope, and entering the scope alone took 72 us on the CI machine's CPU (docs/design/0026).
_PUBLIC, _TILED = Launcher(_compress24), Launcher(_compress24_tiled)


def compress(w: torch.Tensor, prune: bool, dense: bool = False, block=(16, 64), warps: int = 8):
    """``(values, metadata)`` of a 2-D ``w`` (``dense``: the pruned dense weight), or None where ``w`` is refused.

    ``prune``: keep the 2 largest ``|w|`` per group (refused: NaN), else keep
    the non-zeros (refused: a group with more than 2).  A refused weight gives
    None and the caller's torch op names the offending group.  Rows of ``w``
    must have unit stride.  8 warps a block: before 0028's keys, the exact path's kernel ran at 0.81-0.82x of the
    copy bandwidth with 8 on layers of 64M-235M weights, against 0.72-0.73x with 4 (H100, 4ddb2dc+).
    """
    m, k = w.shape
    bits, absmask, inf = _int_view(w)
    bm, bg = block
    grid = (triton.cdiv(m, bm), triton.cdiv(k // 4, bg))
    bad = _flag(w.device)
    if dense:
        out = torch.empty_like(bits)
        values = metadata = out
    else:
        values = torch.empty((m, k // 2), dtype=bits.dtype, device=w.device)
        metadata = torch.empty((m, k // 8), dtype=torch.int16, device=w.device)
        out = values
    _PUBLIC(grid, (bits, values, metadata, out, bad, m, k, w.stride(0)),
            {"PRUNE": prune, "DENSE": dense, "ABS": absmask, "INF": inf, "WIDE": w.element_size() == 4, "BM": bm,
             "BG": bg}, num_warps=warps)
    if bad.item():
        return None
    if dense:
        return out.view(w.dtype)
    return values.view(w.dtype), metadata


def compress_tiled(w: torch.Tensor, prune: bool, steps: int | None = None, warps: int = 4, out=None):
    """``compress``'s parts in the device layout, ``(values [M/16, K/64, 512], metadata [M/16, K/64, 32] int32)``,
    in one pass from ``w`` (no public-format copy), or None where ``w`` is refused.  M % 16 == 0 and K % 64 == 0
    (checked by the caller); rows of ``w`` must have unit stride.  ``out``: contiguous ``(values, metadata)`` of
    those shapes to write them into (rows of a larger one: a MoE projection's experts end to end); a refused ``w``
    leaves them partly written.

    A program takes ``steps`` 64-column steps of a 16-row tile: 8 where K has 32 steps or more, else 2, so that
    a row's last block is not mostly past K (before 0028's keys, H100 at 4ddb2dc+: the kernel at 0.79-0.82x of the
    copy bandwidth with 8 on layers of 64M-235M weights, 0.77-0.78x with 2; at K = 768, 0.74x with 2, 0.58x with 8;
    sparse24-convert-blocks-*.json at 5e4b545 still has 8 best on the large layers)."""
    m, k = w.shape
    steps = steps or (8 if k // 64 >= 32 else 2)
    bits, absmask, inf = _int_view(w)
    grid = (m // 16, triton.cdiv(k // 64, steps))
    bad = _flag(w.device)
    if out is None:
        tv = torch.empty((m // 16, k // 64, 512), dtype=bits.dtype, device=w.device)
        tm = torch.empty((m // 16, k // 64, 32), dtype=torch.int32, device=w.device)
    else:
        tv, tm = out[0].view(bits.dtype), out[1]
    _TILED(grid, (bits, tv, tm.view(torch.int8), bad, k, w.stride(0)),
           {"PRUNE": prune, "ABS": absmask, "INF": inf, "WIDE": w.element_size() == 4, "STEPS": steps},
           num_warps=warps)
    if bad.item():
        return None
    return tv.view(w.dtype), tm


@triton.jit
def _pack24(v_ptr, m_ptr, tv_ptr, tm_ptr, K, UNPACK: tl.constexpr, STEPS: tl.constexpr):
    """One 16-row tile, STEPS 64-column steps: pairs and words between the public format and the device layout."""
    i, sb = tl.program_id(0), tl.program_id(1)
    nsteps = K // 64
    s = sb * STEPS + tl.arange(0, STEPS)[:, None]  # [STEPS, 1]
    live = s < nsteps
    # Pairs: destination order is core-matrix order, d = ((((u * 2 + j) * 2 + h) * 8 + g) * 4 + t (sparse24/layout.py).
    d = tl.arange(0, 256)[None, :]
    t, g, h, j, u = d % 4, (d // 4) % 8, (d // 32) % 2, (d // 64) % 2, d // 128
    public = (16 * i + 8 * h + g).to(tl.int64) * (K // 4) + 16 * s + 8 * u + 4 * j + t
    tiled = (i * nsteps + s).to(tl.int64) * 256 + d
    # Words: lane 4 g + t holds the 16-column quarter t of rows g (low half) and g + 8 (high half).
    w = tl.arange(0, 32)[None, :]
    wg, wt = w // 4, w % 4
    row_lo = (16 * i + wg).to(tl.int64) * (K // 16) + 4 * s + wt  # the format's words as int32: 4 groups each
    word = (i * nsteps + s).to(tl.int64) * 32 + w
    if UNPACK:
        tl.store(v_ptr + public, tl.load(tv_ptr + tiled, mask=live), mask=live)
        both = tl.load(tm_ptr + word, mask=live).to(tl.uint32, bitcast=True)
        for half in tl.static_range(2):
            q = (both >> (16 * half)) & 0xFFFF
            x = (q & 0xF) | ((q >> 4) & 0xF) << 8 | ((q >> 8) & 0xF) << 16 | ((q >> 12) & 0xF) << 24
            tl.store(m_ptr + row_lo + half * 8 * (K // 16), x.to(tl.int32, bitcast=True), mask=live)
    else:
        tl.store(tv_ptr + tiled, tl.load(v_ptr + public, mask=live), mask=live)
        x0 = tl.load(m_ptr + row_lo, mask=live).to(tl.uint32, bitcast=True)
        x1 = tl.load(m_ptr + row_lo + 8 * (K // 16), mask=live).to(tl.uint32, bitcast=True)
        q0 = (x0 & 0xF) | ((x0 >> 8) & 0xF) << 4 | ((x0 >> 16) & 0xF) << 8 | ((x0 >> 24) & 0xF) << 12
        q1 = (x1 & 0xF) | ((x1 >> 8) & 0xF) << 4 | ((x1 >> 16) & 0xF) << 8 | ((x1 >> 24) & 0xF) << 12
        tl.store(tm_ptr + word, (q0 | (q1 << 16)).to(tl.int32, bitcast=True), mask=live)


_PAIR = {2: torch.int32, 4: torch.int64}  # a kept pair as one integer, by element width
_PACK = Launcher(_pack24)


def _launch_pack(values, metadata, tv, tm, k, unpack: bool, steps: int) -> None:
    pair = _PAIR[values.element_size()]
    grid = (tv.shape[0], triton.cdiv(k // 64, steps))
    _PACK(grid, (values.view(pair), metadata.view(torch.int32), tv.view(pair), tm, k), {"UNPACK": unpack, "STEPS": steps},
          num_warps=4)


def pack(values: torch.Tensor, metadata: torch.Tensor, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout.pack`` of contiguous public parts, M % 16 == 0 and K % 64 == 0 (checked by the caller)."""
    m, k = values.shape[0], 2 * values.shape[1]
    tv = torch.empty((m // 16, k // 64, 512), dtype=values.dtype, device=values.device)
    tm = torch.empty((m // 16, k // 64, 32), dtype=torch.int32, device=values.device)
    _launch_pack(values, metadata, tv, tm, k, False, steps)
    return tv, tm


def pack_into(values: torch.Tensor, metadata: torch.Tensor, tv: torch.Tensor, tm: torch.Tensor, steps: int = 4) -> None:
    """``pack`` into given contiguous device-layout tensors of the shapes it returns (rows of a larger one: a MoE
    projection's experts end to end)."""
    _launch_pack(values, metadata, tv, tm, 2 * values.shape[1], False, steps)


def unpack(tv: torch.Tensor, tm: torch.Tensor, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout.unpack`` of contiguous device-layout parts."""
    m, k = 16 * tv.shape[0], 64 * tv.shape[1]
    values = torch.empty((m, k // 2), dtype=tv.dtype, device=tv.device)
    metadata = torch.empty((m, k // 8), dtype=torch.int16, device=tv.device)
    _launch_pack(values, metadata, tv, tm, k, True, steps)
    return values, metadata
