"""Triton 2:4 linear for small N: ``Y[N, M] = act(X[N, K] @ W^T + bias)``, W compressed.

At small N the work should be bound by the weight's bytes.  The kernel streams
the compressed values (``[M, K/2]``) and a derived 4-bit code per group,
expands each ``[BLOCK_M, BLOCK_K]`` tile of W to dense in registers and
multiplies it on the tensor cores with fp32 accumulation.  Bytes per weight
element: 9/16 of dense (a 1.78x bound).

What limits it is not the bytes: the expansion touches every dense element,
M*K of them, on the SMs' integer pipes, and cutting its instructions paid
until the cut below (n <= 16 on an H200 stayed where it was).  Measured on an
H200 (bf16, n = 1 and 16, Llama-70B shapes, best tiles of each;
``bench/sparse24_tiles.py`` sweeps the tiles):

* compares and selects per element (``_expand_where``): 1.0x of dense;
* four tensor-core products per K tile on planar values, one per position in
  the group (the expansion elementwise, so it stays in the MMA's registers):
  0.67-0.76x, for more selects;
* two PRMT byte permutes per group (inline PTX), their selectors looked up
  from the code by a third: 1.11-1.21x at 8192 rows and up, 1.05-1.07x at
  4096x4096; on an H100 1.32-1.51x; with the code cut out by shift and mask
  rather than ``bfe`` (``_EXPAND_SHIFT``), 1.11-1.35x on an H200, and tuning
  measures both;
* the same PRMTs with all four positions' selectors looked up by one PRMT
  (``GROUP_CODES``): eight instructions a group, not twelve, and 324 SASS
  instructions per 64x128 tile step, not 387.  On an H200 (bf16, heuristic
  tiles, both in one run, the 8B and 70B shapes and the 128256x4096 LM head):
  1.01-1.08x faster at n = 32 and 64, and no change at n = 1 and 16
  (0.97-1.01x), where the instructions no longer bound the step.  The ``bfe``
  cut gained most: at 28672x8192 n = 1 1.35x of dense, from 1.11x.

What bounds n <= 16 there is not settled.  Values loaded straight to registers
one tile ahead (no cp.async, no trip through shared memory: 240 instructions
a step) ran 0.80-0.90x of this kernel on the same H200 run: the latency the
cp.async stages hide is worth more than the shared-memory traffic they cost.

Not the tensor cores at all, for n <= 2 (commit 4e62b25, since reverted): an
FMA loop, four FMAs per group and row of X, each thread keeping its groups'
products and K reduced once after the loop, no N padded to 16 and no shared
memory.  Its best tiles ran at 2.0-2.1 TB/s on an H100; timed beside this
kernel's heuristic tiles (bf16, Llama shapes, n = 1 and 2, one run per GPU):
1.07-1.36x of dense against 1.30-1.51x on an H100, 0.83-1.02x against
1.09-1.19x on an H200.  The FMA loop also took the shift-and-mask expansion
(3% at n = 1 on the H100, a 15% loss at n = 2).

The code of a group (``code_metadata``, ``GROUP_CODES``) becomes four table
indices by a multiply and a LOP3; one PRMT looks up the four selectors and two
build the dense pairs from the packed values ``v0 | v1 << 16`` and zero.  The
interpreter cannot run PTX, and 32-bit weights are not pairs of 16-bit
halves, so f32 and the interpreter expand the same indices with selects; a
CPU test runs the PTX itself through a model of the instructions it uses.

W is the MMA's M operand and X^T its N (``acc[BLOCK_M, BLOCK_N]``): a 16-row X
as M filled a 64-row MMA a quarter full.  The codes are blocked, ``int32
[K/64, M, 2]`` (8 codes per word, 64 K-columns per block), so a tile's words
are one contiguous run.

Small M leaves SMs idle, so K is split: each split writes its fp32 partial
and counts itself in its tile's counter; the tile's last split sums the
partials in split order (deterministic whichever arrives last), adds the bias,
applies the activation and re-arms the counter.  One launch, no second pass:
on an H200 that made the 4096x4096 kernel at n <= 16 1.16-1.19x of dense, up
from 1.05-1.07x with a separate reduction kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..sparse24.format import derived_from, output_rows, unpack_positions
from . import Launcher, current_device, raw_stream, stream_capturing
from .activations import ACTIVATION_CODES, act_and_grad

# The code of a group names the dense positions (p0, p1) of its values v0, v1.  The expansion
# turns a code into four table indices, one per dense position j: nibble j of
# ``INDEX_FLIP ^ (code * MULTIPLIER & INDEX_MASK)``.  The multiply lays copies of the code's
# three bits under the nibbles; the mask and flip keep, invert or set each bit.  Every index is
# 4 + i, naming SOURCES[i]: where that position's weight comes from.  The codes and constants
# were found by search (tools/sparse24_group_codes.py; any such set does): with no multiply
# (each nibble a mask of the code itself) no set exists, and with the table's other half in use
# PRMT needs it in a register, which ptxas moves in again for every group.
GROUP_CODES = {(0, 1): 0, (0, 2): 2, (0, 3): 6, (1, 2): 3, (1, 3): 7, (2, 3): 5}
MULTIPLIER, INDEX_MASK, INDEX_FLIP = 0x491, 0x1331, 0x6674
SOURCES = ("v0", "zero", "zero", "v1")


def group_indices(code: int) -> tuple[int, int, int, int]:
    """The table index of each dense position of a group with this code (what the kernel computes)."""
    c = INDEX_FLIP ^ (code * MULTIPLIER & INDEX_MASK)
    return tuple((c >> 4 * j) & 0xF for j in range(4))


# PRMT builds its result byte by byte from the 8 bytes of (b:a), nibble i of the selector naming
# byte i's source: with a = v0 | v1 << 16 and b = 0, selector byte 0x10 copies v0, 0x32 v1 and
# 0x44 a zero.  So the table is 4 selector bytes, bytes 4-7 of a lookup PRMT (its immediate
# operand), and that one PRMT looks up all four positions at once with the indices as its
# selector; two more PRMTs build the dense pairs (w0, w1) and (w2, w3).
_SELECTOR = {"v0": 0x10, "v1": 0x32, "zero": 0x44}
_TABLE = sum(_SELECTOR[src] << 8 * i for i, src in enumerate(SOURCES))


def _expand_ptx(cut: str) -> str:
    """The expansion of one group, its code cut out into ``t`` by the given PTX.

    $2 = v0 | v1 << 16, $3 = the code word, $4 = the code's bit offset; $0, $1 = the dense
    pairs (w0, w1) and (w2, w3).  Eight instructions a group, with ``cut`` two.
    """
    return ("{\n.reg .b32 t, c, s, z;\nmov.b32 z, 0;\n" + cut +
            f"mul.lo.u32 t, t, {MULTIPLIER:#x};\n"
            f"lop3.b32 c, t, {INDEX_MASK:#x}, {INDEX_FLIP:#x}, 0x6a;\n"  # b ? a ^ c : c, bit by bit
            f"prmt.b32 s, z, {_TABLE:#x}, c;\nprmt.b32 $0, $2, z, s;\nshr.b32 s, s, 16;\nprmt.b32 $1, $2, z, s;\n}}")


# Two ways to cut the code out, both timed by tuning (the ``triton`` and ``triton_bfe``
# backends): sm_90 has no bfe, and ptxas spends four instructions on it (two PRMTs, a shift, an
# SGXT), where a shift and a mask take two.  With the previous code (two 2-bit fields, each cut
# out and looked up alone) neither won everywhere (bf16, n = 1 and 16, heuristic tiles, each pair
# in one run): on an H200 shifts gave 1.34x of dense at 28672x8192 (bfe 1.13x) and 1.22-1.26x at
# 4096^2 (1.13-1.20x), on an H100 bfe gave 1.50x at 8192x28672 (shifts 1.24x) and 1.32x at 8192^2
# (1.16x).
_EXPAND_SHIFT = tl.constexpr(_expand_ptx("shr.b32 t, $3, $4;\nand.b32 t, t, 7;\n"))
_EXPAND_BFE = tl.constexpr(_expand_ptx("bfe.u32 t, $3, $4, 3;\n"))


@triton.jit
def _load_w(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, PRMT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The compressed tile of W at columns ``k0 ...``: its values and its code words ``[BLOCK_M, BLOCK_K/32]``.

    For the PRMT expansion the values are int32 pairs ``v0 | v1 << 16`` ``[BLOCK_M, BLOCK_K/4]``
    (svm is even: launch), else ``[BLOCK_M, BLOCK_K/2]`` in W's dtype.
    """
    if PRMT:
        pairs = v_ptr.to(tl.pointer_type(tl.int32))
        v = tl.load(pairs + rm[:, None] * (svm // 2) + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :],
                    mask=m_mask[:, None], other=0)
    else:
        v = tl.load(v_ptr + rm[:, None] * svm + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :] * svk,
                    mask=m_mask[:, None], other=0.0)
    j = tl.arange(0, BLOCK_K // 32)  # word j of the tile: block k0/64 + j/2, word j%2 of the row's pair
    words = tl.load(meta_ptr + (k0 // 64 + j // 2)[None, :] * (2 * M) + rm[:, None] * 2 + (j % 2)[None, :],
                    mask=m_mask[:, None], other=0)
    return v, words


@triton.jit
def _dense(w0, w1, w2, w3, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # join(join(w0, w2), join(w1, w3))[..., i, j] is w_(2i + j): row-major it is w0 w1 w2 w3.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_M, BLOCK_K])


# The table again, two bits per entry (1 v0, 2 v1, 0 zero), for the expansion by selects.
_SOURCE_BITS = tl.constexpr(sum({"v0": 1, "v1": 2, "zero": 0}[src] << 2 * i for i, src in enumerate(SOURCES)))
_MULTIPLIER = tl.constexpr(MULTIPLIER)
_INDEX_MASK = tl.constexpr(INDEX_MASK)
_INDEX_FLIP = tl.constexpr(INDEX_FLIP)


@triton.jit
def _pick(c, j: tl.constexpr, v0, v1):
    """Dense position ``j`` of each group, from its indices ``c``."""
    source = (_SOURCE_BITS >> (2 * ((c >> (4 * j)) & 3))) & 3  # index 4 + i: bit 2 is always set
    return tl.where(source == 1, v0, tl.where(source == 2, v1, tl.zeros_like(v0)))


@triton.jit
def _expand(v, words, dt: tl.constexpr, PRMT: tl.constexpr, BFE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dense tile ``[BLOCK_M, BLOCK_K]`` of a compressed one (``_load_w``).

    16-bit W by the inline PTX (``_EXPAND_SHIFT`` / ``_EXPAND_BFE``); any dtype, and the
    interpreter, by compares and selects on the same indices.
    """
    words = tl.reshape(tl.broadcast_to(words[:, :, None], [BLOCK_M, BLOCK_K // 32, 8]), [BLOCK_M, BLOCK_K // 4])
    shift = ((tl.arange(0, BLOCK_K // 4) % 8) * 4)[None, :]  # the group's code in its word
    if PRMT:
        lo, hi = tl.inline_asm_elementwise(_EXPAND_BFE if BFE else _EXPAND_SHIFT, "=r,=r,r,r,r", [v, words, shift],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return _dense(lo.to(tl.int16).to(dt, bitcast=True), (lo >> 16).to(tl.int16).to(dt, bitcast=True),
                      hi.to(tl.int16).to(dt, bitcast=True), (hi >> 16).to(tl.int16).to(dt, bitcast=True),
                      BLOCK_M, BLOCK_K)
    else:
        c = _INDEX_FLIP ^ (((words >> shift) & 7) * _MULTIPLIER & _INDEX_MASK)
        v0, v1 = tl.split(tl.reshape(v, [BLOCK_M, BLOCK_K // 4, 2]))
        return _dense(_pick(c, 0, v0, v1), _pick(c, 1, v0, v1), _pick(c, 2, v0, v1), _pick(c, 3, v0, v1),
                      BLOCK_M, BLOCK_K)


@triton.jit
def sparse24_kernel(
    x_ptr, v_ptr, meta_ptr, bias_ptr, y_ptr, ws_ptr, count_ptr,
    N, M, K_PER_SPLIT,
    sxn, sxk, svm, svk, syn, sym,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, PRMT: tl.constexpr,
    BFE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    mask = n_mask[None, :] & m_mask[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = k_start + K_PER_SPLIT
    for k0 in range(k_start, k_end, BLOCK_K):
        v, words = _load_w(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, PRMT, BLOCK_M, BLOCK_K)
        w = _expand(v, words, v_ptr.dtype.element_ty, PRMT, BFE, BLOCK_M, BLOCK_K)
        xt = tl.load(x_ptr + rn[None, :] * sxn + (k0 + tl.arange(0, BLOCK_K))[:, None] * sxk,
                     mask=n_mask[None, :], other=0.0)
        if IEEE:  # f32: full-precision products, as the reference
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:  # f16/bf16 values are exact in their own dtype: the tensor cores see the true weights
            acc += tl.dot(w, xt)
    if SPLIT:
        # fp32 partials [splits, N, M]; the tile's last split to arrive sums them in split order
        # (the same order whichever arrives last: the result does not depend on timing) and
        # re-arms the tile's counter for the next launch on this stream.
        splits = tl.num_programs(1)
        partial = ws_ptr + rn[None, :] * M + rm[:, None]
        tl.store(partial + pid_k * N * M, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        count = count_ptr + pid_n * tl.num_programs(0) + pid_m
        last = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == splits - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(splits):  # .cg: from L2, where the other SMs' partials are
                acc += tl.load(partial + s * N * M, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(count, 0)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)[:, None]
        OUT16: tl.constexpr = y_ptr.dtype.element_ty.primitive_bitwidth == 16
        acc, _ = act_and_grad(acc, ACT, False, False, OUT16)
        tl.store(y_ptr + rn[None, :] * syn + rm[:, None] * sym, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sparse24_reduce_kernel(
    ws_ptr, bias_ptr, y_ptr, N, M, SPLITS, syn, sym,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """y[n, :] = act(sum over splits of the fp32 partials + bias)."""
    n = tl.program_id(1)
    rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rm < M
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(ws_ptr + (s * N + n) * M + rm, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rm, mask=mask, other=0.0).to(tl.float32)
    OUT16: tl.constexpr = y_ptr.dtype.element_ty.primitive_bitwidth == 16
    acc, _ = act_and_grad(acc, ACT, False, False, OUT16)
    tl.store(y_ptr + n * syn + rm * sym, acc.to(y_ptr.dtype.element_ty), mask=mask)


# -- host side ------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    block_n: int
    block_m: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3
    bfe: bool = False  # the code cut out by bfe, not by shift and mask (_EXPAND_BFE)


@functools.lru_cache(maxsize=4096)
def config_for(n: int, m: int, k: int, sm_count: int, itemsize: int = 2, bfe: bool = False,
               wide: bool = False) -> Config:
    """Tiles for a problem: N padded to an MMA width up to 64, K split until the SMs are busy.

    ``wide`` asks for 128-row tiles at N tiles of 32 and 64 (16-bit weights): the
    ``triton_m128`` candidate.
    """
    block_n = max(16, min(64, triton.next_power_of_2(max(n, 1))))
    if wide:
        return _wide_config(n, m, k, sm_count, block_n)
    # Few rows (a K or V projection): 32-row tiles make twice the programs (1024x4096, n <= 16, on
    # an H200: 1.08-1.13x of dense against 0.92-0.99x with 64 rows).
    block_m = 32 if block_n == 16 and triton.cdiv(m, 64) < sm_count // 4 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # fp32 tiles are twice the bytes: 256-wide K tiles in 3 stages overflow shared memory.  N tiles
    # of 32 and 64 do best with 128-wide K tiles (on an H100 at n = 32, 4096x14336 1.43x of dense
    # against 1.26x), and so do 16-wide ones on weights whose M tiles fill the SMs twice.  With
    # fewer M tiles, since the group codes became one lookup, 256-wide ones pay (H200 sweep, n = 1
    # and 16: 8192x8192 1.35-1.39x against 1.33x, 8192x28672 1.44-1.47x against 1.38-1.40x,
    # 4096x4096 1.31-1.34x against 1.23-1.31x; 28672x8192 1.36x at 128, 1.32x at 256).  The bfe
    # candidate takes them wherever it can.
    wide_k = block_n < 64 and (bfe or (block_n == 16 and tiles < 2 * sm_count))
    widths = (256, 128, 64) if itemsize <= 2 and wide_k else (128, 64)
    block_k = next(b for b in widths if k % b == 0)
    steps = k // block_k
    if block_n == 16 and block_k < 256:
        # About 4 programs per SM, each with at least 4 K steps to amortise its start
        # (bench/sparse24_tiles.py on an H200: the best split was 2-4 on the Llama shapes).
        splits = max(1, min(steps // 4, triton.cdiv(4 * sm_count, tiles)))
    else:
        # Wider N tiles want about two programs per SM: each split reads its x tile again
        # (H100, n = 32 and 64, the six Llama shapes: 8192x8192 n = 64 1.08x of dense at 4
        # splits, 1.32x at 2; 14336x4096 1.06x at 2, 1.32x at 1).  So do 256-wide K tiles, whose
        # shared memory fits two programs an SM: two per SM is one wave (H200 sweep at n = 1 and
        # 16: 8192x8192 1.35x of dense at 2 splits, below 1.33x at 4; 128256x4096 1.44-1.46x at 1).
        splits = max(1, min(steps // 4, round(2 * sm_count / tiles)))
    if block_n == 16 and block_k == 128 and tiles >= 2 * sm_count:
        # Tall weights at n <= 16 still want K split to 2048 per program, though their tiles
        # alone fill the SMs (on an H200: 28672x8192 1.33-1.37x of dense at 4 splits, 1.21-1.25x
        # at 2; 128256x4096 1.39-1.40x at 2, 1.32-1.33x at 1).
        splits = max(splits, min(steps // 4, k // 2048))
    while steps % splits:
        splits -= 1
    # A fourth stage pays at N tiles of 32 and 64 (H100: 8192x8192 n = 64, 1.26x -> 1.32x), and at
    # 256-wide K tiles on long programs (H200, n = 1: 8192x8192 1.39x against 1.35x, 16 steps each;
    # 4096x4096, 4 steps each, 1.27x against 1.31x).
    deep = (block_n > 16 and block_k == 128) or (block_n == 16 and block_k == 256 and steps // splits >= 16)
    stages = 2 if itemsize > 2 else 4 if deep else 3
    return Config(block_n, block_m, block_k, splits, num_stages=stages, bfe=bfe)


def _wide_config(n: int, m: int, k: int, sm_count: int, block_n: int) -> Config:
    """128-row tiles for N tiles of 32 and 64: each x tile serves twice the rows, so K splits re-read less.

    From an H200 sweep (bench/sparse24_tiles.py, bf16, the Llama-70B shapes):
    4 K splits beat the 64-row heuristic's 1-2 (8192x28672 at n = 32 1.33x of dense
    against 1.15x, at n = 64 1.21x against 1.11x; 8192x8192 at n = 32 1.29x against
    1.19x; 28672x8192 at n = 32 1.20x against 0.90x, where 2048 K columns per
    program paid though the tiles alone fill the SMs).  A fourth stage paid at 32-wide
    N tiles, not at 64.  The H100 sweep that set the 64-row heuristic preferred that
    one: tuning times both.
    """
    if block_n < 32:
        raise ValueError(f"wide tiles are for N tiles of 32 and 64; n = {n} runs 16-wide ones")
    block_m, block_k = 128, 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if block_n == 64 and tiles >= sm_count:
        # Tiles that fill the SMs alone, 64 wide: no split and 8 warps, half the expansion per thread.
        # H200 sweep (bf16, n = 48 and 64): 28672x8192 1.08x of dense against 1.02-1.06x with 4
        # splits, the 128256x4096 LM head 1.20-1.24x against 1.10-1.12x with 2; fewer tiles (8192
        # rows) keep their splits: there one program per tile ran 0.45-0.53x.
        return Config(block_n, block_m, block_k, 1, num_warps=8, num_stages=3)
    steps = k // block_k
    splits = max(1, min(steps // 4, max(round(2 * sm_count / tiles), min(4, k // 2048))))
    while steps % splits:
        splits -= 1
    return Config(block_n, block_m, block_k, splits, num_stages=4 if block_n == 32 else 3)


def partial_count(cfg: Config, n: int, m: int) -> int:
    """The fp32 partials of a split launch: ``[splits, N, M]``."""
    return cfg.splits * n * m if cfg.splits > 1 else 0


def code_metadata(metadata: torch.Tensor) -> torch.Tensor:
    """int32 ``[K/64, M, 2]``: per 64-column block and row, two words of eight 4-bit group codes.

    The code of group ``8q + i`` of a row (``GROUP_CODES``) sits in bits
    ``4i..4i+3`` of word ``q``; word ``q`` is ``[q // 2, row, q % 2]``.  K must
    be a multiple of 64.
    """
    m = metadata.shape[0]
    positions = unpack_positions(metadata)  # [M, K/4, 2]
    table = torch.zeros(16, dtype=torch.int64, device=metadata.device)
    for (p0, p1), code in GROUP_CODES.items():
        table[p0 | p1 << 2] = code
    codes = table[positions[..., 0] | positions[..., 1] << 2]  # [M, K/4]
    groups = codes.shape[1]
    shifts = torch.arange(0, 32, 4, device=metadata.device, dtype=torch.int64)
    words = u32_bits((codes.reshape(m, groups // 8, 8) << shifts).sum(-1))  # [M, K/32]
    return words.reshape(m, groups // 16, 2).permute(1, 0, 2).contiguous()


def u32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32 tensors holding the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pairs_readable(values: torch.Tensor) -> bool:
    """Whether the PRMT path can read ``values`` as int32 pairs in place."""
    return values.stride(1) == 1 and values.stride(0) % 2 == 0 and values.data_ptr() % 4 == 0


def bias_act_(y: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    """In place, one pass: ``y = act(y + bias)`` for a contiguous ``y [N, M]``.

    The epilogue of backends whose library cannot fuse it (cuSPARSELt fuses
    relu alone, and no bias we can rebind per call): the partial-sum kernel
    with one "partial", y itself.  (The Triton GEMM's own K splits are summed
    inside its launch.)
    """
    n, m = y.shape
    if n == 0 or m == 0:
        return
    block = min(1024, triton.next_power_of_2(m))
    _reduce((triton.cdiv(m, block), n), (y, bias if bias is not None else y, y, n, m, 1, y.stride(0), y.stride(1)),
            dict(ACT=ACTIVATION_CODES[activation or "identity"], HAS_BIAS=bias is not None, BLOCK=block), num_warps=4)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_gemm = Launcher(sparse24_kernel)
_reduce = Launcher(sparse24_reduce_kernel)


def launch(x, values, metadata, bias, y, activation: str | None, cfg: Config, capturing: bool | None = None) -> None:
    """``y = act(x @ W^T + bias)``; shapes, dtypes and alignment were checked by the plan.

    ``capturing`` says whether the caller's stream is being captured into a
    CUDA graph, where the caller knows (None: asked here).
    """
    BoundLinear(cfg, activation, capturing).launch(x, values, metadata, bias, y)


class BoundLinear:
    """``call(x, values, metadata, bias) -> act(x @ W^T + bias)`` at one tile config: a backend's bound call.

    The output is allocated here.  ``capturing`` is the descriptor's ``graph``
    (dispatch binds a call recorded into a CUDA graph to a plan of its own), or
    None where unknown.  Everything per call that does not depend on the call
    is built here once: on the GPU machines' hosts, hashing the tile config
    (a dataclass) alone cost a microsecond a call.
    """

    __slots__ = ("cfg", "activation", "capturing", "_keys", "_builds")

    def __init__(self, cfg: Config, activation: str | None, capturing: bool | None):
        self.cfg, self.activation, self.capturing = cfg, activation, capturing
        # derived_from keys, by has_bias: strings, whose hashes Python caches.
        self._keys = tuple(f"launch {cfg} {activation} {has_bias}" for has_bias in (False, True))
        self._builds = tuple(functools.partial(_WeightLaunch, cfg=cfg, activation=activation, has_bias=has_bias)
                             for has_bias in (False, True))

    def __call__(self, x, values, metadata, bias) -> torch.Tensor:
        y, x2, y2 = output_rows(x, values.shape[0])
        self.launch(x2, values, metadata, bias, y2)
        return y

    def launch(self, x, values, metadata, bias, y) -> None:
        if x.shape[0] == 0 or values.shape[0] == 0:
            return
        if _gemm.interpreted or not x.is_cuda:
            _launch_jit(x, values, metadata, bias, y, self.activation, self.cfg)
            return
        has_bias = bias is not None
        # Host objects only (device_work=False); their own layouts are derived_from too.
        prepared = derived_from(values, metadata, self._keys[has_bias], self._builds[has_bias], device_work=False)
        prepared(x, bias, y, self.capturing)


def _group_codes(values, metadata):
    return derived_from(values, metadata, "group_codes_blocked", lambda v, meta: code_metadata(meta))


_SCRATCH: dict = {}  # (device index, raw stream) -> [int32 tile counters, all zero; fp32 partials]


def split_scratch(device_index: int, stream: int, tiles: int, partials: int,
                  capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiles`` zeroed int32 arrival counters and room for ``partials`` fp32 values, for one split launch.

    A split launch leaves every counter at zero when it ends and reads its
    partials only within itself, so one scratch per stream serves every launch
    on it, in stream order, with no allocation per call.  The counters are a
    buffer of their own: a region that once held partials is not zero.

    Under graph capture each launch gets its own scratch, zeroed inside the
    graph (a replay may run on another stream, concurrently with eager launches
    on this one).  The caller holds both until its launch is recorded; freed
    after it, their memory is reused only by work ordered after it.
    """
    if capturing:
        device = torch.device("cuda", device_index)
        return (torch.zeros(tiles, dtype=torch.int32, device=device),
                torch.empty(partials, dtype=torch.float32, device=device))
    scratch = _SCRATCH.get((device_index, stream))
    if scratch is None or scratch[0].numel() < tiles or scratch[1].numel() < partials:
        scratch = _grown_scratch(device_index, stream, tiles, partials)
    return scratch[0], scratch[1]


def _grown_scratch(device_index: int, stream: int, tiles: int, partials: int) -> list:
    device = torch.device("cuda", device_index)
    scratch = _SCRATCH.get((device_index, stream))
    if scratch is None:
        scratch = _SCRATCH[device_index, stream] = [torch.zeros(4096, dtype=torch.int32, device=device),
                                                    torch.empty(1 << 18, dtype=torch.float32, device=device)]
    if scratch[0].numel() < tiles:
        scratch[0] = torch.zeros(2 * tiles, dtype=torch.int32, device=device)
    if scratch[1].numel() < partials:
        scratch[1] = torch.empty(2 * partials, dtype=torch.float32, device=device)
    return scratch


def _tiles(cfg: Config, n: int, m: int) -> tuple[int, int, int]:
    """The launch grid: (M tiles, K splits, N tiles)."""
    return (m + cfg.block_m - 1) // cfg.block_m, cfg.splits, (n + cfg.block_n - 1) // cfg.block_n


def _launch_jit(x, values, metadata, bias, y, activation, cfg) -> None:
    """``launch`` through the JIT's own launch: the Triton interpreter's path (CPU tensors)."""
    n, k = x.shape
    m = values.shape[0]
    grid = _tiles(cfg, n, m)
    split = cfg.splits > 1
    ws = torch.empty(partial_count(cfg, n, m), dtype=torch.float32) if split else y
    counters = torch.zeros(grid[0] * grid[2], dtype=torch.int32) if split else y
    _gemm(grid, (x, values, _group_codes(values, metadata), bias if bias is not None else values, y, ws, counters,
                 n, m, k // cfg.splits, *x.stride(), *values.stride(), *y.stride()),
          dict(ACT=ACTIVATION_CODES[activation or "identity"], HAS_BIAS=bias is not None, SPLIT=split,
               IEEE=x.dtype == torch.float32, PRMT=False, BFE=cfg.bfe, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
               BLOCK_K=cfg.block_k),
          num_warps=cfg.num_warps, num_stages=cfg.num_stages)


class _WeightLaunch:
    """The compiled launch of one weight at one tile config; per call only x, y, bias and N vary.

    Built once per weight state (``derived_from``): the weight's pointers and
    strides are fixed in it.  Each call looks its kernel up by the varying
    arguments' raw values (N, strides, pointer alignment) and launches it with
    the pointers as ints: the host time of a call is then a dictionary lookup
    and the launch (``Launcher``'s full key of 17 arguments, and two cache
    lookups, cost 14 us per call on an H200's host).
    """

    _MAX_KEYS = 256

    def __init__(self, values, metadata, cfg: Config, activation: str | None, has_bias: bool):
        # Holds nothing of the weight but what is derived from it: the cache entry holding this
        # object lives as long as ``values`` does, so a reference to ``values`` would keep it alive.
        self.codes = _group_codes(values, metadata)
        prmt = values.dtype != torch.float32
        # A strided view the PRMT path cannot read as int32 pairs: one contiguous copy, kept with the weight.
        self.copy = None
        if prmt and not _pairs_readable(values):
            self.copy = derived_from(values, metadata, "values_contiguous", lambda v, meta: v.contiguous())
        read = self.copy if self.copy is not None else values
        self.weight = (read.data_ptr(), self.codes.data_ptr(), *read.stride())
        self.dtype, self.itemsize = values.dtype, values.element_size()
        self.cfg = cfg
        self.consts = dict(ACT=ACTIVATION_CODES[activation or "identity"], HAS_BIAS=has_bias, SPLIT=cfg.splits > 1,
                           IEEE=not prmt, PRMT=prmt, BFE=cfg.bfe,
                           BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k)
        self.m, self.k_split = values.shape[0], 2 * values.shape[1] // cfg.splits
        self.device = values.get_device()
        self._kernels: dict = {}  # per-call key -> (Compiled, grid, tiles, partials)

    def __call__(self, x, bias, y, capturing: bool | None = None) -> None:
        device = self.device
        if current_device() != device:  # the kernel and the stream are the weight's device's
            with torch.cuda.device(device):
                self(x, bias, y, capturing)
            return
        n = x.shape[0]
        xp, yp = x.data_ptr(), y.data_ptr()
        vp, codes, svm, svk = self.weight
        bp = bias.data_ptr() if bias is not None else vp
        sx, sy = x.stride(), y.stride()
        key = (n, sx, sy, xp & 15, bp & 15, yp & 15)
        hit = self._kernels.get(key)
        if hit is None:
            hit = self._compile(x, bias, y, key)
        kernel, grid, tiles, partials = hit
        stream = raw_stream(device)
        if tiles:  # a K split: its partials and counters live in scratch
            if capturing is None:
                capturing = stream_capturing()
            counters, ws = split_scratch(device, stream, tiles, partials, capturing)
            cp, wp = counters.data_ptr(), ws.data_ptr()
        else:  # never read: placeholders
            cp = wp = yp
        kernel(grid, (xp, vp, codes, bp, yp, wp, cp, n, self.m, self.k_split, sx[0], sx[1], svm, svk, sy[0], sy[1]),
               stream)

    def _compile(self, x, bias, y, key):
        """The kernel for this call's specialization (``key``); the scratch stands in by dtype (it is aligned)."""
        n = key[0]
        if len(self._kernels) >= self._MAX_KEYS:
            self._kernels.clear()
        cfg = self.cfg
        split = cfg.splits > 1
        ws = torch.empty(1, dtype=torch.float32, device=x.device) if split else y
        counters = torch.empty(1, dtype=torch.int32, device=x.device) if split else y
        # Stand-ins for the weight and its codes: only their dtypes and 16-byte alignment matter to
        # the compile (the codes are an allocation of their own: aligned).
        vp, _, svm, svk = self.weight
        weight = torch.empty(32, dtype=self.dtype, device=x.device)[(vp % 16) // self.itemsize:]
        codes = torch.empty(16, dtype=torch.int32, device=x.device)
        args = (x, weight, codes, bias if bias is not None else weight, y, ws, counters,
                n, self.m, self.k_split, *x.stride(), svm, svk, *y.stride())
        kernel = _gemm.compiled(args, self.consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        grid = _tiles(cfg, n, self.m)
        tiles = grid[0] * grid[2] if split else 0
        hit = self._kernels[key] = (kernel, grid, tiles, partial_count(cfg, n, self.m) if split else 0)
        return hit
