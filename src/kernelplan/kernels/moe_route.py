"""A MoE layer's routing in one Triton launch: the (token, k) pairs sorted by expert, and the rows of x gathered.

``Sparse24Experts`` ran it as six torch ops (a stable sort of the ids, ``searchsorted`` for the experts' offsets,
a division and an ``index_select`` for the rows of x, a ``float`` of the routing weights, zeros for the output):
116-150 us of host work of an eager call's 200-300 on an H100's host, more than the two grouped GEMM launches
(docs/design/0034).  Here:

* each program takes a chunk of ``B`` pairs and a block of ``BH`` columns.  It counts every chunk's ids (one
  histogram each: the experts' sizes, and the chunks before its own), so it knows where each of its pairs goes
  without a second launch: ``starts[e] + before[e] + its rank among its chunk's pairs of expert e``.  That is the
  stable sort's order: a pair's place depends on (expert, pair index) alone, whichever program computes it;
* it copies its pairs' rows of x (as bits: no arithmetic, which the Triton interpreter gets wrong for bf16) to
  their places, and, in its first column block, writes ``order``, the routing weights as float32 and, in program
  0, the offsets;
* ids outside ``[0, E)`` (transformers' expert-parallel sentinel is ``E``) sort last; their rows of ``y`` are
  zeroed, since the down launch writes only the experts' rows.

Every program recounts all chunks: ``P / B`` histograms of ``B`` ids, a few at a decode's sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import Launcher

_B = 128  # pairs a program places: its rank step compares B x B ids
_HIST = 1024  # ids a step of the counting loop
_BH = 128  # columns a block of the copy
_PROGRAMS = 1024  # about this many programs where the pairs allow: the fewer, the fewer recounts


@triton.jit
def _bucket(ids_ptr, p, P, E, EP: tl.constexpr):
    """Each pair's expert, ``E`` for ids outside ``[0, E)``, and ``EP - 1`` (a bin past E) for lanes past P."""
    e = tl.load(ids_ptr + p, mask=p < P, other=0)
    b = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
    return tl.where(p < P, b, EP - 1)


@triton.jit(do_not_specialize=["P", "TOP_K", "SPAN"])  # a call's pairs vary: one kernel for every count
def _route(ids_ptr, w_ptr, x_ptr, xs_ptr, order_ptr, offsets_ptr, scale_ptr, y_ptr, P, TOP_K, E, H, stride_x,
           YW, stride_y, SPAN, B: tl.constexpr, HIST: tl.constexpr, EP: tl.constexpr, BH: tl.constexpr,
           ZERO_Y: tl.constexpr):
    c = tl.program_id(0)
    hb = tl.program_id(1)
    lanes = tl.arange(0, B)
    bins = tl.arange(0, EP)
    # Every expert's count, and the counts of the chunks before this one (pairs before c * B): HIST ids a step.
    wide = tl.arange(0, HIST)
    total = tl.zeros([EP], dtype=tl.int32)
    before = tl.zeros([EP], dtype=tl.int32)
    for j in range(0, tl.cdiv(P, HIST)):
        q = j * HIST + wide
        b = _bucket(ids_ptr, q, P, E, EP)
        total += tl.histogram(b, EP)
        before += tl.histogram(tl.where(q < c * B, b, EP - 1), EP)
    starts = tl.cumsum(total, 0) - total  # where each expert's rows begin; the sentinel's after them all

    p = c * B + lanes
    b = _bucket(ids_ptr, p, P, E, EP)
    live = p < P
    rank = tl.sum(((b[:, None] == b[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), 1)
    place = tl.sum(tl.where(b[:, None] == bins[None, :], (starts + before)[None, :], 0), 1) + rank

    if hb == 0:
        tl.store(order_ptr + place, p.to(tl.int64), mask=live)
        tl.store(scale_ptr + p, tl.load(w_ptr + p, mask=live, other=0).to(tl.float32), mask=live)
        if c == 0:
            tl.store(offsets_ptr + bins, starts, mask=bins <= E)

    routed = live & (b < E)
    dropped = live & (b == E)
    src = x_ptr + (p // TOP_K).to(tl.int64)[:, None] * stride_x
    dst = xs_ptr + place.to(tl.int64)[:, None] * H
    for blk in range(0, SPAN):  # SPAN column blocks a program
        cols = (hb * SPAN + blk) * BH + tl.arange(0, BH)
        rows = tl.load(src + cols[None, :], mask=routed[:, None] & (cols[None, :] < H))
        tl.store(dst + cols[None, :], rows, mask=routed[:, None] & (cols[None, :] < H))
        if ZERO_Y:
            tl.store(y_ptr + p.to(tl.int64)[:, None] * stride_y + cols[None, :],
                     tl.zeros([B, BH], dtype=rows.dtype), mask=dropped[:, None] & (cols[None, :] < YW))


_ROUTE = Launcher(_route)
_BITS = {2: torch.int16, 4: torch.int32}


def route(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, experts: int,
          y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xs, order, offsets, scale)`` for ``ids`` / ``weights`` ``[T, k]`` (contiguous, as transformers' top-k gives
    them) and ``x [T, H]``:

    * ``order`` int64 ``[T k]``: the pairs ``t * k + j`` sorted by expert, stably (ids outside ``[0, experts)`` last);
    * ``offsets`` int32 ``[experts + 1]``: where each expert's rows start in that order, the last entry where the
      others' start;
    * ``xs [T k, H]``: row ``n`` is ``x[order[n] // k]``, for the experts' rows (the others' are not written);
    * ``scale`` float32 ``[T k]``: ``weights`` flat, as float32 (by pair, as the scattered store reads it).

    With ``y`` (``[T k, W]``, rows of unit stride), the rows of the pairs outside the experts are zeroed in it.
    These are internal operands: ``Sparse24Experts`` checks the shapes."""
    pairs, top_k = ids.numel(), ids.shape[-1]
    h = x.shape[1]
    xs = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    order = torch.empty(pairs, dtype=torch.int64, device=x.device)
    offsets = torch.empty(experts + 1, dtype=torch.int32, device=x.device)
    scale = torch.empty(pairs, dtype=torch.float32, device=x.device)
    if pairs == 0:
        offsets.zero_()
        return xs, order, offsets, scale
    bits = _BITS[x.element_size()]
    width = max(h, y.shape[1]) if y is not None else h
    chunks, blocks = triton.cdiv(pairs, _B), triton.cdiv(width, _BH)
    span = triton.cdiv(blocks, max(1, min(blocks, _PROGRAMS // chunks)))  # column blocks a program copies
    grid = (chunks, triton.cdiv(blocks, span))
    _ROUTE(grid, (ids, weights, x.view(bits), xs.view(bits), order, offsets, scale,
                  y.view(bits) if y is not None else xs.view(bits), pairs, top_k, experts, h, x.stride(0),
                  y.shape[1] if y is not None else 0, y.stride(0) if y is not None else 0, span),
           {"B": _B, "HIST": _HIST, "EP": triton.next_power_of_2(experts + 2), "BH": _BH, "ZERO_Y": y is not None},
           num_warps=8)
    return xs, order, offsets, scale
