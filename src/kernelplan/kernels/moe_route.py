"""A MoE layer's routing in two or three Triton launches: the (token, k) pairs sorted by expert, and the rows of x
gathered.

``Sparse24Experts`` ran it as six torch ops (a stable sort of the ids, ``searchsorted`` for the experts' offsets,
a division and an ``index_select`` for the rows of x, a ``float`` of the routing weights, zeros for the output):
116-150 us of host work of an eager call's 200-300 on an H100's host, more than the two grouped GEMM launches
(docs/design/0034).  Here:

* ``_count``: a program a chunk of ``B`` pairs writes how many of them each expert has;
* ``_scan``, from ``_SCAN_MIN_CHUNKS`` chunks on: the counts summed down the chunks once (each chunk's row becomes
  the sums of the chunks before it, and a last row every chunk's);
* ``_route``: a program a chunk and a span of columns reads those sums (or, with fewer chunks, sums the counts
  itself: every chunk's, where each expert's rows start; the chunks' before its own), so each of its pairs goes to
  ``starts[e] + before[e] + its rank among its chunk's pairs of expert e``.  That is the stable sort's order: a
  pair's place depends on (expert, pair index) alone, whichever program computes it.  It copies its pairs' rows of
  x there (as bits: no arithmetic, which the Triton interpreter gets wrong for bf16) and, in its first span, writes
  ``order``, the routing weights as float32 and, in program 0, the offsets;
* ids outside ``[0, E)`` (transformers' expert-parallel sentinel is ``E``) sort last; their rows of ``y`` are
  zeroed, since the down launch writes only the experts' rows;
* where the routing weights scale each pair's input (``WEIGHINGS``: Llama-4's MoE scales each token's copy by its
  router's score), the copy multiplies each row by its weight, as the module's product rounds it, and ``scale`` is
  1 (the down launch's scattered store weighs nothing more).

One launch that recounted every chunk's ids in each program (2c47d5c) cost up to 275 us more than the torch ops on
the device at 16384 pairs over 128 experts (H200): a histogram is dearer than summing the counts it leaves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import Launcher, on_device, raw_stream

# Pairs a program places.  Its rank step compares B x B ids, held in registers: 199 a thread at 128 (one program an
# SM), 40-64 at 32.  Graph time of an experts call, H200, 16384 pairs: 0.94-1.07x at 32 against 1.00-1.12x at 128 of
# the torch ops' routing (bench/results/sparse24-moe-route-chunks-h200.json).
_B = 32
_CB = 32  # chunks' counts a step of the summing loop, at most: CB x EP counts stay under 8192 (64 registers a thread
# at 512 bins with 16, 127 with 32)
_BH = 128  # columns a block of the copy
_PROGRAMS = 512  # about this many programs where the pairs allow: each sums every chunk's counts
# Past this many chunks, a third launch (_scan) sums the counts once, and each _route program reads its chunk's sums:
# summing them in every program reads chunks x chunks x EP counts (268 MB at 16384 pairs over 128 experts).
# An experts call's graph time, H200 (bench/results/sparse24-moe-route-scan-h200.json): with the scan 0.99-1.02x of
# without at 256 pairs (8 chunks), 0.96-1.00x at 1024, 0.86-1.00x at 4096, 0.78-1.00x at 16384, 0.40-0.53x at 65536
# (the least change with 8 experts: their counts are 16 bins a chunk).
_SCAN_MIN_CHUNKS = 32
_SCAN_BINS = 16  # bins a _scan program sums over every chunk
_SCAN_STEP = 8192  # counts a step of a _scan program's loop
# How the routing weights apply -> the _route kernel's WEIGH: to each pair's output (transformers' top-k experts:
# route passes them on as ``scale``), or to its row of x as it is copied, the weight itself or the sigmoid of it
# rounded to its dtype (Llama-4's router's scores, from its top logits: Llama4Router.forward).
WEIGHINGS = {"outputs": 0, "inputs": 1, "sigmoid inputs": 2}


@triton.jit
def _bucket(ids_ptr, p, P, E, EP: tl.constexpr):
    """Each pair's expert, ``E`` for ids outside ``[0, E)``, and ``EP - 1`` (a bin past E) for lanes past P."""
    e = tl.load(ids_ptr + p, mask=p < P, other=0)
    b = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
    return tl.where(p < P, b, EP - 1)


@triton.jit(do_not_specialize=["P"])  # a call's pairs vary: one kernel for every count
def _count(ids_ptr, counts_ptr, P, E, B: tl.constexpr, EP: tl.constexpr):
    """Row c of ``counts [chunks, EP]``: how many of chunk c's pairs each expert has."""
    c = tl.program_id(0)
    counts = tl.histogram(_bucket(ids_ptr, c * B + tl.arange(0, B), P, E, EP), EP)
    tl.store(counts_ptr + c * EP + tl.arange(0, EP), counts)


@triton.jit(do_not_specialize=["CHUNKS"])
def _scan(counts_ptr, CHUNKS, EP: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr):
    """Bins ``EB * program ...`` of ``counts [CHUNKS + 1, EP]``: row c becomes the counts of the chunks before c (an
    exclusive sum down the chunks), and row CHUNKS every chunk's.  CB chunks a step."""
    bins = tl.program_id(0) * EB + tl.arange(0, EB)
    run = tl.zeros([EB], dtype=tl.int32)
    for j in range(0, CHUNKS, CB):
        chunk = j + tl.arange(0, CB)
        at = counts_ptr + chunk[:, None] * EP + bins[None, :]
        counts = tl.load(at, mask=(chunk < CHUNKS)[:, None], other=0)
        tl.store(at, tl.cumsum(counts, 0) - counts + run[None, :], mask=(chunk < CHUNKS)[:, None])
        run += tl.sum(counts, 0)
    tl.store(counts_ptr + CHUNKS * EP + bins, run)


@triton.jit(do_not_specialize=["P", "TOP_K", "SPAN"])
def _route(ids_ptr, counts_ptr, w_ptr, x_ptr, xs_ptr, order_ptr, offsets_ptr, scale_ptr, y_ptr, P, TOP_K, E, H,
           stride_x, YW, stride_y, SPAN, B: tl.constexpr, CB: tl.constexpr, EP: tl.constexpr, BH: tl.constexpr,
           ZERO_Y: tl.constexpr, SCANNED: tl.constexpr, WEIGH: tl.constexpr):
    c = tl.program_id(0)
    hb = tl.program_id(1)
    lanes = tl.arange(0, B)
    bins = tl.arange(0, EP)
    if SCANNED:  # _scan left the chunks' sums before this one in row c, every chunk's in the last row
        before = tl.load(counts_ptr + c * EP + bins)
        total = tl.load(counts_ptr + tl.cdiv(P, B) * EP + bins)
    else:  # every expert's count, and those of the chunks before this one, from the counts: CB chunks a step
        total = tl.zeros([EP], dtype=tl.int32)
        before = tl.zeros([EP], dtype=tl.int32)
        for j in range(0, tl.cdiv(P, B), CB):
            chunk = j + tl.arange(0, CB)
            counts = tl.load(counts_ptr + chunk[:, None] * EP + bins[None, :],
                             mask=(chunk < tl.cdiv(P, B))[:, None], other=0)
            total += tl.sum(counts, 0)
            before += tl.sum(tl.where((chunk < c)[:, None], counts, 0), 0)
    starts = tl.cumsum(total, 0) - total  # where each expert's rows begin; the sentinel's after them all

    p = c * B + lanes
    b = _bucket(ids_ptr, p, P, E, EP)
    live = p < P
    rank = tl.sum(((b[:, None] == b[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), 1)
    place = tl.gather(starts + before, b, 0) + rank

    w = tl.load(w_ptr + p, mask=live, other=0).to(tl.float32)
    if WEIGH == 2:  # the router's scores: the sigmoid in float32, rounded to the logits' dtype
        w = tl.sigmoid(w).to(w_ptr.dtype.element_ty).to(tl.float32)
    if hb == 0:
        tl.store(order_ptr + place, p.to(tl.int64), mask=live)
        tl.store(scale_ptr + p, w if WEIGH == 0 else tl.full([B], 1.0, tl.float32), mask=live)
        if c == 0:
            tl.store(offsets_ptr + bins, starts, mask=bins <= E)

    routed = live & (b < E)
    dropped = live & (b == E)
    src = x_ptr + (p // TOP_K).to(tl.int64)[:, None] * stride_x
    dst = xs_ptr + place.to(tl.int64)[:, None] * H
    for blk in range(0, SPAN):  # SPAN column blocks a program
        cols = (hb * SPAN + blk) * BH + tl.arange(0, BH)
        rows = tl.load(src + cols[None, :], mask=routed[:, None] & (cols[None, :] < H))
        if WEIGH != 0:  # x's product with the weight in float32, rounded once, as torch's product of the two is
            rows = (rows.to(tl.float32) * w[:, None]).to(xs_ptr.dtype.element_ty)
        tl.store(dst + cols[None, :], rows, mask=routed[:, None] & (cols[None, :] < H))
        if ZERO_Y:
            tl.store(y_ptr + p.to(tl.int64)[:, None] * stride_y + cols[None, :],
                     tl.zeros([B, BH], dtype=y_ptr.dtype.element_ty), mask=dropped[:, None] & (cols[None, :] < YW))


_COUNT, _SCAN, _ROUTE = Launcher(_count), Launcher(_scan), Launcher(_route)
_BITS = {2: torch.int16, 4: torch.int32}


class _Plan:
    """``route``'s launches for one call signature: each one's grid, integer arguments, constexprs and warps, and (off
    the interpreter) its kernel compiled for the signature's specialization, then launched with the call's pointers.

    ``Launcher`` keys a compiled kernel by the specialization of each of a launch's arguments (17 for ``_route``) on
    every call, where a call signature is one dict lookup: route's host Python took 33-37 us that way on the CPU CI
    machine and 12 bound, its launches stubbed (docs/design/0079)."""

    __slots__ = ("counts_len", "count", "scan", "route", "kernels", "weighs")

    def __init__(self, pairs: int, top_k: int, experts: int, h: int, stride_x: int, y_cols: tuple | None,
                 weigh: int):
        width = max(h, y_cols[0]) if y_cols is not None else h
        # Integer arithmetic, not triton.cdiv / next_power_of_2: those are constexpr functions, about 4.5 us a call on
        # the host (five here were a sixth of an experts call's host work on the CPU CI machine).
        chunks, blocks = -(-pairs // _B), -(-width // _BH)
        span = -(-blocks // max(1, min(blocks, _PROGRAMS // chunks)))  # column blocks a program copies
        bins = 1 << (experts + 1).bit_length()  # the power of two at or past experts + 2
        scanned = chunks >= _SCAN_MIN_CHUNKS
        self.counts_len = (chunks + scanned) * bins
        step = max(1, min(_CB, 8192 // bins))  # chunks a summing step
        eb = min(bins, _SCAN_BINS)
        # Each launch: (grid, the integer arguments after its pointers, constexprs, warps); no _scan below
        # _SCAN_MIN_CHUNKS chunks.
        self.count = ((chunks, 1, 1), (pairs, experts), {"B": _B, "EP": bins}, 4)
        self.scan = ((bins // eb, 1, 1), (chunks,), {"EP": bins, "EB": eb, "CB": max(1, _SCAN_STEP // eb)}, 4) \
            if scanned else None
        self.route = ((chunks, -(-blocks // span), 1),
                      (pairs, top_k, experts, h, stride_x, *(y_cols or (0, 0)), span),
                      {"B": _B, "CB": step, "EP": bins, "BH": _BH, "ZERO_Y": y_cols is not None, "SCANNED": scanned,
                       "WEIGH": weigh}, 8)
        self.weighs = weigh != 0
        self.kernels = None  # (count, scan or None, route), compiled at the first call off the interpreter

    def launch(self, ids, counts, weights, x, xs, order, offsets, scale, y) -> None:
        """The launches on these operands (``y`` None: xs in its place, which ZERO_Y False leaves unwritten)."""
        if self.kernels is None or _COUNT.interpreted:
            # Rows copied as they are, as bits: no arithmetic, which the interpreter gets wrong for bf16.  Weighed,
            # in their dtype: the kernel converts them to float32 first.
            bits = _BITS[x.element_size()]
            rows = (x, xs) if self.weighs else (x.view(bits), xs.view(bits))
            steps = ((_COUNT, self.count, (ids, counts)), (_SCAN, self.scan, (counts,)),
                     (_ROUTE, self.route, (ids, counts, weights, *rows, order, offsets, scale,
                                           (y if y is not None else xs).view(bits))))
            if _COUNT.interpreted:
                for launcher, (grid, ints, constexprs, warps), ptrs in (s for s in steps if s[1] is not None):
                    launcher(grid, ptrs + ints, constexprs, num_warps=warps)
                return
            self.kernels = tuple(None if plan is None else
                                 launcher.compiled(ptrs + plan[1], plan[2], num_warps=plan[3])
                                 for launcher, plan, ptrs in steps)
        count, scan, route = self.kernels
        device = x.get_device()
        stream, i, c = raw_stream(device), ids.data_ptr(), counts.data_ptr()
        with on_device(device):  # the kernels are loaded into x's device's context
            count(self.count[0], (i, c) + self.count[1], stream)
            if scan is not None:
                scan(self.scan[0], (c,) + self.scan[1], stream)
            route(self.route[0], (i, c, weights.data_ptr(), x.data_ptr(), xs.data_ptr(), order.data_ptr(),
                                  offsets.data_ptr(), scale.data_ptr(), (y if y is not None else xs).data_ptr())
                  + self.route[1], stream)


_PLANS: dict = {}  # route's plans, by call signature
_MAX_PLANS = 256


def route(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, experts: int, y: torch.Tensor | None = None,
          weigh: str = "outputs") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xs, order, offsets, scale)`` for ``ids`` / ``weights`` ``[T, k]`` (contiguous, as transformers' top-k gives
    them) and ``x [T, H]``:

    * ``order`` int64 ``[T k]``: the pairs ``t * k + j`` sorted by expert, stably (ids outside ``[0, experts)`` last);
    * ``offsets`` int32 ``[experts + 1]``: where each expert's rows start in that order, the last entry where the
      others' start;
    * ``xs [T k, H]``: row ``n`` is ``x[order[n] // k]``, for the experts' rows (the others' are not written);
      weighing the inputs (``weigh``, a key of ``WEIGHINGS``), times its pair's weight (or its sigmoid) in x's dtype;
    * ``scale`` float32 ``[T k]``: ``weights`` flat, as float32 (by pair, as the scattered store reads it); weighing
      the inputs, ones.

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
    y_cols = (y.shape[1], y.stride(0)) if y is not None else None
    # Everything a launch specializes on: the sizes, strides and dtypes, and each outside pointer's 16-byte alignment
    # (the buffers made here are the allocator's, always aligned).  Not the module's constants: a test that changes
    # them gives _PLANS a new dict too.
    key = (x.get_device(), x.dtype, ids.dtype, weights.dtype, pairs, top_k, experts, h, x.stride(0), y_cols,
           ids.data_ptr() % 16, weights.data_ptr() % 16, x.data_ptr() % 16, 0 if y is None else y.data_ptr() % 16,
           weigh)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(pairs, top_k, experts, h, x.stride(0), y_cols, WEIGHINGS[weigh])
    counts = torch.empty(plan.counts_len, dtype=torch.int32, device=x.device)
    plan.launch(ids, counts, weights, x, xs, order, offsets, scale, y)
    return xs, order, offsets, scale
