"""Triton 2:4 linear for small N: ``Y[N, M] = act(X[N, K] @ W^T + bias)``, W compressed.

At small N the work is bound by the weight's bytes.  The kernel streams the
compressed values (``[M, K/2]``) and a packed copy of the metadata, expands
each ``[BLOCK_M, BLOCK_K]`` tile of W to dense in registers and multiplies it
on the tensor cores with fp32 accumulation.  Bytes per weight element: 9/16 of
dense (a 1.78x bound), against 10/16 for the public byte-per-group metadata.

Two layout choices, each measured on an H200 against variants of this kernel
(bf16, n = 1 and 16, Llama-70B shapes, best tiles of each; the tile sweep of
the kernel as it stands is ``bench/sparse24_tiles.py``):

* W is the MMA's M operand and X^T its N (``acc[BLOCK_M, BLOCK_N]``): with X
  as M, a 16-row X filled a 64-row MMA a quarter full (0.68-0.86x of dense
  before, 0.87-0.96x after);
* the packed metadata is blocked, ``int32 [K/64, M, 2]`` (4 bits per group, 8
  groups per word, 64 K-columns per block), so a tile's words are one
  contiguous run: row-major ``[M, K/32]`` gave 16-byte pieces 3.5 KB apart
  (to 1.0-1.06x of dense).  Without any metadata the same loop reaches 1.4-1.6x:
  what is left is the second load stream, not the expansion arithmetic.

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

from ..sparse24.format import _metadata_bytes, derived_from
from .activations import ACTIVATION_CODES, act_and_grad


@triton.jit
def _dense_tile(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dense ``[BLOCK_M, BLOCK_K]`` tile of W at columns ``k0 ...`` from values and blocked metadata."""
    G: tl.constexpr = BLOCK_K // 4
    v = tl.load(v_ptr + rm[:, None] * svm + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :] * svk,
                mask=m_mask[:, None], other=0.0)
    j = tl.arange(0, BLOCK_K // 32)  # word j of the tile: block k0/64 + j/2, word j%2 of the row's pair
    words = tl.load(meta_ptr + (k0 // 64 + j // 2)[None, :] * (2 * M) + rm[:, None] * 2 + (j % 2)[None, :],
                    mask=m_mask[:, None], other=0)
    words = tl.reshape(tl.broadcast_to(words[:, :, None], [BLOCK_M, BLOCK_K // 32, 8]), [BLOCK_M, G])
    nib = (words >> ((tl.arange(0, G) % 8) * 4)[None, :]) & 0xF
    p0 = nib & 3
    p1 = nib >> 2
    v0, v1 = tl.split(tl.reshape(v, [BLOCK_M, G, 2]))
    zero = tl.zeros_like(v0)
    # p0 < p1, so position 0 can only hold v0 and position 3 only v1.
    w0 = tl.where(p0 == 0, v0, zero)
    w1 = tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, zero))
    w2 = tl.where(p0 == 2, v0, tl.where(p1 == 2, v1, zero))
    w3 = tl.where(p1 == 3, v1, zero)
    # join(join(w0, w2), join(w1, w3))[..., i, j] is w_(2i + j): row-major it is w0 w1 w2 w3.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_M, BLOCK_K])


@triton.jit
def sparse24_kernel(
    x_ptr, v_ptr, meta_ptr, bias_ptr, out_ptr,
    N, M, K_PER_SPLIT,
    sxn, sxk, svm, svk, son, som, sos,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr,
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
        w = _dense_tile(v_ptr, meta_ptr, rm, m_mask, k0, svm, svk, M, BLOCK_M, BLOCK_K)
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
    # fp32 tiles are twice the bytes: 256-wide K tiles in 3 stages overflow shared memory.
    block_k = next(b for b in ((256, 128, 64) if itemsize <= 2 else (128, 64)) if k % b == 0)
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


def packed_metadata(metadata: torch.Tensor) -> torch.Tensor:
    """int32 ``[K/64, M, 2]``: per 64-column block and row, two words of eight 4-bit groups.

    Group ``8q + i`` of a row sits in bits ``4i..4i+3`` of word ``q``; word ``q``
    is ``[q // 2, row, q % 2]``.  K must be a multiple of 64.
    """
    m = metadata.shape[0]
    nibbles = _metadata_bytes(metadata).to(torch.int64).reshape(m, -1) & 0xF  # [M, K/4], a group per byte
    groups = nibbles.shape[1]
    shifts = torch.arange(0, 32, 4, device=metadata.device, dtype=torch.int64)
    words = (nibbles.reshape(m, groups // 8, 8) << shifts).sum(-1)  # [M, K/32]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # u32 bits in an int32
    return words.reshape(m, groups // 16, 2).permute(1, 0, 2).contiguous()


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
    sparse24_reduce_kernel[(triton.cdiv(m, block), n)](
        y, bias if bias is not None else y, y, n, m, 1, y.stride(0), y.stride(1),
        ACT=ACTIVATION_CODES[activation or "identity"], HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(x, values, metadata, bias, y, activation: str | None, cfg: Config, workspace) -> None:
    """``y = act(x @ W^T + bias)``; shapes, dtypes and alignment were checked by the plan."""
    n, k = x.shape
    m = values.shape[0]
    if n == 0 or m == 0:
        return
    packed = derived_from(values, metadata, "packed_metadata_blocked", lambda v, meta: packed_metadata(meta))
    act = ACTIVATION_CODES[activation or "identity"]
    ieee = x.dtype == torch.float32
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m), cfg.splits, triton.cdiv(n, cfg.block_n))
    common = dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.splits == 1:
        sparse24_kernel[grid](
            x, values, packed, bias if has_bias else values, y, n, m, k,
            x.stride(0), x.stride(1), *values.stride(), y.stride(0), y.stride(1), 0,
            ACT=act, HAS_BIAS=has_bias, PARTIAL=False, IEEE=ieee, **common,
        )
        return
    ws = workspace[: workspace_bytes(cfg, n, m)].view(torch.float32)
    sparse24_kernel[grid](
        x, values, packed, values, ws, n, m, k // cfg.splits,
        x.stride(0), x.stride(1), *values.stride(), m, 1, n * m,
        ACT=act, HAS_BIAS=False, PARTIAL=True, IEEE=ieee, **common,
    )
    block = min(1024, triton.next_power_of_2(m))
    sparse24_reduce_kernel[(triton.cdiv(m, block), n)](
        ws, bias if has_bias else ws, y, n, m, cfg.splits, y.stride(0), y.stride(1),
        ACT=act, HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
    )
