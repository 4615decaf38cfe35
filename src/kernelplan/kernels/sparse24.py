"""Triton 2:4 linear for small N: ``Y[N, M] = act(X[N, K] @ W^T + bias)``, W compressed.

At small N the work should be bound by the weight's bytes.  The kernel streams
the compressed values (``[M, K/2]``) and a derived 4-bit code per group,
expands each ``[BLOCK_M, BLOCK_K]`` tile of W to dense in registers and
multiplies it on the tensor cores with fp32 accumulation.  Bytes per weight
element: 9/16 of dense (a 1.78x bound).

What limits it is the expansion's instruction count, not the bytes: the
expansion touches every dense element, M*K of them, on the SMs' integer
pipes.  Measured on an H200 (bf16, n = 1 and 16, Llama-70B shapes, best tiles
of each; ``bench/sparse24_tiles.py`` sweeps the tiles):

* compares and selects per element (``_expand_where``): 1.0x of dense;
* four tensor-core products per K tile on planar values, one per position in
  the group (the expansion elementwise, so it stays in the MMA's registers):
  0.67-0.76x, for more selects;
* two PRMT byte permutes per group (``_expand_prmt``, inline PTX), their
  selectors looked up from the code by a third: 1.11-1.21x at 8192 rows and
  up, 1.05-1.07x at 4096x4096.

The code of a group (``code_metadata``) is ``a | b << 2``: ``a`` names the low
pair of the dense group ``(w0, w1)``, ``b`` the high pair ``(w2, w3)``, so that
each pair is one PRMT of the packed values ``v0 | v1 << 16`` and zero.  The
interpreter cannot run PTX, and 32-bit weights are not pairs of 16-bit
halves, so f32 and the interpreter expand the same codes with selects.

W is the MMA's M operand and X^T its N (``acc[BLOCK_M, BLOCK_N]``): a 16-row X
as M filled a 64-row MMA a quarter full.  The codes are blocked, ``int32
[K/64, M, 2]`` (8 codes per word, 64 K-columns per block), so a tile's words
are one contiguous run.

Small M leaves SMs idle, so K is split: each split writes fp32 partials to the
plan's workspace and a second kernel sums them, adds the bias and applies the
activation.  Without a split, bias and activation are fused into the GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..sparse24.format import derived_from, unpack_positions
from . import Launcher, interpreting
from .activations import ACTIVATION_CODES, act_and_grad

# (pos0, pos1) -> code a | b << 2, where
#   a: 0 (v0, v1)  1 (v0, 0)  2 (0, v0)  3 (0, 0)     the low pair (w0, w1)
#   b: 0 (0, 0)    1 (v1, 0)  2 (0, v1)  3 (v0, v1)   the high pair (w2, w3)
GROUP_CODES = {(0, 1): 0 | 0 << 2, (0, 2): 1 | 1 << 2, (0, 3): 1 | 2 << 2,
               (1, 2): 2 | 1 << 2, (1, 3): 2 | 2 << 2, (2, 3): 3 | 3 << 2}

# One group: $2 = v0 | v1 << 16, $3 = its code word, $4 = the code's bit offset; $0, $1 = the
# low and high dense pairs.  `prmt d, a, b, c` builds d byte by byte from the 8 bytes of (b:a),
# nibble i of c naming byte i's source: 0x10 selects v0, 0x32 v1, 0x44 a zero byte.  The
# selector of each pair is itself looked up by PRMT in an 8-byte table of the four
# selectors (a at bytes 2a, 2a + 1: c = a * 0x22 + 0x10).
_EXPAND_PTX = tl.constexpr("""
{
.reg .b32 i, c, s, o, z, la, lb, ha, hb;
mov.b32 z, 0;
mov.b32 la, 0x44103210;
mov.b32 lb, 0x44441044;
mov.b32 ha, 0x44324444;
mov.b32 hb, 0x32103244;
bfe.u32 i, $3, $4, 2;
mad.lo.u32 c, i, 34, 16;
prmt.b32 s, la, lb, c;
prmt.b32 $0, $2, z, s;
add.u32 o, $4, 2;
bfe.u32 i, $3, o, 2;
mad.lo.u32 c, i, 34, 16;
prmt.b32 s, ha, hb, c;
prmt.b32 $1, $2, z, s;
}
""")


@triton.jit
def _codes(meta_ptr, rm, m_mask, k0, M, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each group's code word ``[BLOCK_M, BLOCK_K/4]`` and the code's bit offset in it ``[1, BLOCK_K/4]``."""
    j = tl.arange(0, BLOCK_K // 32)  # word j of the tile: block k0/64 + j/2, word j%2 of the row's pair
    words = tl.load(meta_ptr + (k0 // 64 + j // 2)[None, :] * (2 * M) + rm[:, None] * 2 + (j % 2)[None, :],
                    mask=m_mask[:, None], other=0)
    words = tl.reshape(tl.broadcast_to(words[:, :, None], [BLOCK_M, BLOCK_K // 32, 8]), [BLOCK_M, BLOCK_K // 4])
    return words, ((tl.arange(0, BLOCK_K // 4) % 8) * 4)[None, :]


@triton.jit
def _dense(w0, w1, w2, w3, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # join(join(w0, w2), join(w1, w3))[..., i, j] is w_(2i + j): row-major it is w0 w1 w2 w3.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_M, BLOCK_K])


@triton.jit
def _expand_prmt(v_ptr, meta_ptr, rm, m_mask, k0, svm, M, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dense tile of W at columns ``k0 ...``, 16-bit W, two PRMTs per group."""
    pairs = v_ptr.to(tl.pointer_type(tl.int32))  # v0 | v1 << 16 per group; svm is even (launch)
    v = tl.load(pairs + rm[:, None] * (svm // 2) + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :],
                mask=m_mask[:, None], other=0)
    words, shift = _codes(meta_ptr, rm, m_mask, k0, M, BLOCK_M, BLOCK_K)
    lo, hi = tl.inline_asm_elementwise(_EXPAND_PTX, "=r,=r,r,r,r", [v, words, shift],
                                       dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    dt: tl.constexpr = v_ptr.dtype.element_ty
    return _dense(lo.to(tl.int16).to(dt, bitcast=True), (lo >> 16).to(tl.int16).to(dt, bitcast=True),
                  hi.to(tl.int16).to(dt, bitcast=True), (hi >> 16).to(tl.int16).to(dt, bitcast=True),
                  BLOCK_M, BLOCK_K)


@triton.jit
def _expand_where(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same tile by compares and selects: any dtype, and the interpreter."""
    v = tl.load(v_ptr + rm[:, None] * svm + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :] * svk,
                mask=m_mask[:, None], other=0.0)
    words, shift = _codes(meta_ptr, rm, m_mask, k0, M, BLOCK_M, BLOCK_K)
    code = (words >> shift) & 0xF
    a = code & 3
    b = code >> 2
    v0, v1 = tl.split(tl.reshape(v, [BLOCK_M, BLOCK_K // 4, 2]))
    zero = tl.zeros_like(v0)
    return _dense(tl.where(a <= 1, v0, zero), tl.where(a == 0, v1, tl.where(a == 2, v0, zero)),
                  tl.where(b == 1, v1, tl.where(b == 3, v0, zero)), tl.where(b >= 2, v1, zero),
                  BLOCK_M, BLOCK_K)


@triton.jit
def sparse24_kernel(
    x_ptr, v_ptr, meta_ptr, bias_ptr, out_ptr,
    N, M, K_PER_SPLIT,
    sxn, sxk, svm, svk, son, som, sos,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr, PRMT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        if PRMT:
            w = _expand_prmt(v_ptr, meta_ptr, rm, m_mask, k0, svm, M, BLOCK_M, BLOCK_K)
        else:
            w = _expand_where(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, BLOCK_M, BLOCK_K)
        xt = tl.load(x_ptr + rn[None, :] * sxn + (k0 + tl.arange(0, BLOCK_K))[:, None] * sxk,
                     mask=n_mask[None, :], other=0.0)
        if IEEE:  # f32: full-precision products, as the reference
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:  # f16/bf16 values are exact in their own dtype: the tensor cores see the true weights
            acc += tl.dot(w, xt)
    out = out_ptr + rn[None, :] * son + rm[:, None] * som
    mask = n_mask[None, :] & m_mask[:, None]
    if PARTIAL:
        tl.store(out + pid_k * sos, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)[:, None]
        OUT16: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth == 16
        acc, _ = act_and_grad(acc, ACT, False, False, OUT16)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


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


@functools.lru_cache(maxsize=4096)
def config_for(n: int, m: int, k: int, sm_count: int, itemsize: int = 2) -> Config:
    """Tiles for a problem: N padded to an MMA width up to 64, K split until the SMs are busy."""
    block_n = max(16, min(64, triton.next_power_of_2(max(n, 1))))
    block_m = 64
    # fp32 tiles are twice the bytes: 256-wide K tiles in 3 stages overflow shared memory.  A
    # 64-wide N tile does best with 128-wide K tiles (bench/sparse24_tiles.py on an H200).
    widths = (256, 128, 64) if itemsize <= 2 and block_n < 64 else (128, 64)
    block_k = next(b for b in widths if k % b == 0)
    stages = 3 if itemsize <= 2 else 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = k // block_k
    # About 4 programs per SM, each with at least 4 K steps to amortise its start
    # (bench/sparse24_tiles.py on an H200: the best split was 2-4 on the Llama shapes).
    splits = max(1, min(steps // 4, triton.cdiv(4 * sm_count, tiles)))
    while steps % splits:
        splits -= 1
    return Config(block_n, block_m, block_k, splits, num_stages=stages)


def workspace_bytes(cfg: Config, n: int, m: int) -> int:
    return 4 * cfg.splits * n * m if cfg.splits > 1 else 0


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
    words = (codes.reshape(m, groups // 8, 8) << shifts).sum(-1)  # [M, K/32]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # u32 bits in an int32
    return words.reshape(m, groups // 16, 2).permute(1, 0, 2).contiguous()


def _pairs_readable(values: torch.Tensor) -> bool:
    """Whether the PRMT path can read ``values`` as int32 pairs in place."""
    return values.stride(1) == 1 and values.stride(0) % 2 == 0 and values.data_ptr() % 4 == 0


def bias_act_(y: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    """In place, one pass: ``y = act(y + bias)`` for a contiguous ``y [N, M]``.

    The epilogue of backends whose library cannot fuse it (cuSPARSELt fuses
    relu alone, and no bias we can rebind per call); it is the split-K
    reduction kernel with one "split", y itself.
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


def launch(x, values, metadata, bias, y, activation: str | None, cfg: Config, workspace) -> None:
    """``y = act(x @ W^T + bias)``; shapes, dtypes and alignment were checked by the plan."""
    n, k = x.shape
    m = values.shape[0]
    if n == 0 or m == 0:
        return
    codes = derived_from(values, metadata, "group_codes_blocked", lambda v, meta: code_metadata(meta))
    act = ACTIVATION_CODES[activation or "identity"]
    ieee = x.dtype == torch.float32
    prmt = not ieee and not interpreting()
    if prmt and not _pairs_readable(values):  # a strided view: one contiguous copy, kept with the weight
        values = derived_from(values, metadata, "values_contiguous", lambda v, meta: v.contiguous())
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m), cfg.splits, triton.cdiv(n, cfg.block_n))
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tiles = dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k)
    if cfg.splits == 1:
        _gemm(grid, (x, values, codes, bias if has_bias else values, y, n, m, k,
                     x.stride(0), x.stride(1), *values.stride(), y.stride(0), y.stride(1), 0),
              dict(ACT=act, HAS_BIAS=has_bias, PARTIAL=False, IEEE=ieee, PRMT=prmt, **tiles), **options)
        return
    ws = workspace[: workspace_bytes(cfg, n, m)].view(torch.float32)
    _gemm(grid, (x, values, codes, values, ws, n, m, k // cfg.splits,
                 x.stride(0), x.stride(1), *values.stride(), m, 1, n * m),
          dict(ACT=act, HAS_BIAS=False, PARTIAL=True, IEEE=ieee, PRMT=prmt, **tiles), **options)
    block = min(1024, triton.next_power_of_2(m))
    _reduce((triton.cdiv(m, block), n), (ws, bias if has_bias else ws, y, n, m, cfg.splits, y.stride(0), y.stride(1)),
            dict(ACT=act, HAS_BIAS=has_bias, BLOCK=block), num_warps=4)
