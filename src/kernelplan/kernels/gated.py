"""Triton kernels for the gated activations, forward and backward, any rank and strides.

One kernel serves both directions.  It walks the *output-space* shape (x's
shape with the split dim halved); every operand is addressed through its own
strides there, and the second half of x (and of dx) sits ``half * stride``
further on.  The host first collapses that shape: size-1 dims are dropped and
neighbours that are contiguous in every operand are merged, so the common
cases reach the kernel as a 2-D ``[R, C]`` problem.  ``C`` is the output's
innermost dim, ``R`` the dim x is contiguous along (the transposed-input case)
or else the next one; up to six further "batch" dims are decoded per program.
A ``[BLOCK_R, BLOCK_C]`` tile lets Triton coalesce loads and stores even when
x and the output are contiguous along different dims.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import ACTIVATION_CODES, act_and_grad
from .triton_cache import compiling

MAX_BATCH_DIMS = 6  # + the R and C tile dims = the 8-rank limit of the descriptor


@triton.jit
def _peel(b, size, sx, sd, so, ox, od, oo):
    """Take the innermost remaining batch dim off the batch index ``b``."""
    i = b % size
    return b // size, ox + i * sx, od + i * sd, oo + i * so


@triton.jit
def gated_kernel(
    x_ptr, dy_ptr, out_ptr,
    R, C, x_half, out_half,
    sx_r, sx_c, sd_r, sd_c, so_r, so_c,
    D1, D2, D3, D4, D5,
    SX0, SX1, SX2, SX3, SX4, SX5,
    SD0, SD1, SD2, SD3, SD4, SD5,
    SO0, SO1, SO2, SO3, SO4, SO5,
    ACT: tl.constexpr, GATE_FIRST: tl.constexpr, BACKWARD: tl.constexpr, F64: tl.constexpr,
    NB: tl.constexpr, INT64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    tiles_c = tl.cdiv(C, BLOCK_C)
    tiles_r = tl.cdiv(R, BLOCK_R)
    tc = pid % tiles_c
    rest = pid // tiles_c
    tr = rest % tiles_r
    b = rest // tiles_r

    ox = b * 0
    od = b * 0
    oo = b * 0
    if NB > 5:
        b, ox, od, oo = _peel(b, D5, SX5, SD5, SO5, ox, od, oo)
    if NB > 4:
        b, ox, od, oo = _peel(b, D4, SX4, SD4, SO4, ox, od, oo)
    if NB > 3:
        b, ox, od, oo = _peel(b, D3, SX3, SD3, SO3, ox, od, oo)
    if NB > 2:
        b, ox, od, oo = _peel(b, D2, SX2, SD2, SO2, ox, od, oo)
    if NB > 1:
        b, ox, od, oo = _peel(b, D1, SX1, SD1, SO1, ox, od, oo)
    if NB > 0:
        ox += b * SX0
        od += b * SD0
        oo += b * SO0

    rows = tr * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tc * BLOCK_C + tl.arange(0, BLOCK_C)
    if INT64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    if EVEN:  # tiles divide [R, C]: no predicates, which the compute-heavy GeGLU feels
        mask = None
    else:
        mask = (rows < R)[:, None] & (cols < C)[None, :]
    xo = ox + rows[:, None] * sx_r + cols[None, :] * sx_c
    # Convert right after the load: the math runs in fp32 (fp64 for fp64).
    compute = tl.float64 if F64 else tl.float32
    lo = tl.load(x_ptr + xo, mask=mask).to(compute)
    hi = tl.load(x_ptr + xo + x_half, mask=mask).to(compute)
    if GATE_FIRST:
        g = lo
        v = hi
    else:
        g = hi
        v = lo
    OUT16: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth == 16
    f, df = act_and_grad(g, ACT, BACKWARD, F64, OUT16)

    oo = oo + rows[:, None] * so_r + cols[None, :] * so_c
    if BACKWARD:
        dy = tl.load(dy_ptr + od + rows[:, None] * sd_r + cols[None, :] * sd_c, mask=mask).to(compute)
        dv = dy * f
        dg = dy * v * df
        if GATE_FIRST:
            d_lo = dg
            d_hi = dv
        else:
            d_lo = dv
            d_hi = dg
        tl.store(out_ptr + oo, d_lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + oo + out_half, d_hi.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + oo, (v * f).to(out_ptr.dtype.element_ty), mask=mask)


# -- host side ------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The collapsed output-space problem: batch dims (outer first), then R, then C.

    ``strides[t]`` are operand ``t``'s strides in that order (x, dy, out).
    """

    sizes: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]


def collapse(sizes, strides) -> Layout:
    """Drop size-1 dims, merge neighbours contiguous in every operand, order R and C last."""
    dims = [(s, tuple(st[i] for st in strides)) for i, s in enumerate(sizes) if s != 1]
    merged: list[tuple[int, tuple[int, ...]]] = []
    for size, st in dims:
        if merged and all(prev == cur * size for prev, cur in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    while len(merged) < 2:
        merged.insert(0, (1, (0,) * len(strides)))
    x_of, out_of = (lambda d: abs(d[1][0])), (lambda d: abs(d[1][-1]))
    # C: where the output is contiguous (else its smallest stride); R: where x is contiguous, else next.
    c = min(range(len(merged)), key=lambda i: (out_of(merged[i]), -i))
    others = [i for i in range(len(merged)) if i != c]
    x_unit = [i for i in others if x_of(merged[i]) == 1 and x_of(merged[c]) != 1]
    r = x_unit[0] if x_unit else min(others, key=lambda i: (out_of(merged[i]), -i))
    batch = sorted((i for i in others if i != r), key=lambda i: -out_of(merged[i]))
    order = batch + [r, c]
    return Layout(
        sizes=tuple(merged[i][0] for i in order),
        strides=tuple(tuple(merged[i][1][t] for i in order) for t in range(len(strides))),
    )


def _tile(layout: Layout) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps).  Unit stride along C everywhere: wide rows; else square tiles."""
    r, c = layout.sizes[-2], layout.sizes[-1]
    # Measured on an H200 (bench/gated_tiles.py): every 1-8K-element tile reaches the copy
    # bandwidth for SwiGLU; 2K with 4 warps keeps more programs in flight for the
    # compute-heavier GeGLU.  Transposed: 128 x 32, long along x's unit stride, was best.
    if all(st[-1] == 1 for st in layout.strides):
        block_c = min(triton.next_power_of_2(c), 512)
        block_r = min(triton.next_power_of_2(r), max(1, 2048 // block_c))
    else:
        block_c = min(triton.next_power_of_2(c), 32)
        block_r = min(triton.next_power_of_2(r), 128)
    return block_r, block_c, 4


def _needs_int64(layout: Layout, halves: tuple[int, int], block: tuple[int, int]) -> bool:
    """Whether any element offset the kernel forms (masked lanes included) can pass 2**31 - 1."""
    padded = list(layout.sizes)
    padded[-2] += block[0]
    padded[-1] += block[1]
    reach = max(sum((s - 1) * abs(st) for s, st in zip(padded, strides)) for strides in layout.strides)
    return reach + max(halves) >= 2**31 - 1


def launch(x: torch.Tensor, dy: torch.Tensor | None, out: torch.Tensor, desc) -> None:
    """Forward (``dy is None``: ``out`` is y) or backward (``out`` is dx).  Checked by the plan."""
    params = _launch_params(desc, x.stride(), None if dy is None else dy.stride(), out.stride())
    if params is not None:
        grid, scalars, meta, launched = params
        if launched:
            gated_kernel[grid](x, x if dy is None else dy, out, *scalars, **meta)
            return
        with compiling():  # a problem's first launch is where Triton compiles: into kernelplan's folder
            gated_kernel[grid](x, x if dy is None else dy, out, *scalars, **meta)
        launched.append(True)


@functools.lru_cache(maxsize=4096)
def _launch_params(desc, x_stride, dy_stride, out_stride):
    """Grid, scalar arguments and constexprs for one (problem, strides): computed once, then a dict hit."""
    out_shape = desc.output_shape()
    if math.prod(out_shape) == 0:
        return None
    split, half = desc.split_dim, desc.input_shape[desc.split_dim] // 2
    backward = dy_stride is not None
    layout = collapse(out_shape, [x_stride, dy_stride if backward else out_stride, out_stride])
    nb = len(layout.sizes) - 2  # <= MAX_BATCH_DIMS: the descriptor caps the rank at 8
    halves = (half * x_stride[split], half * out_stride[split] if backward else 0)
    block_r, block_c, warps = _tile(layout)
    pad = MAX_BATCH_DIMS - nb
    batch_sizes = list(layout.sizes[1:nb]) + [1] * (MAX_BATCH_DIMS - 1 - max(nb - 1, 0))
    batch = [list(st[:nb]) + [0] * pad for st in layout.strides]
    (sx_r, sx_c), (sd_r, sd_c), (so_r, so_c) = (st[-2:] for st in layout.strides)
    r, c = layout.sizes[-2:]
    grid = (math.prod(layout.sizes[:nb]) * triton.cdiv(r, block_r) * triton.cdiv(c, block_c),)
    scalars = (r, c, *halves, sx_r, sx_c, sd_r, sd_c, so_r, so_c, *batch_sizes, *batch[0], *batch[1], *batch[2])
    meta = dict(
        ACT=ACTIVATION_CODES[desc.activation],
        GATE_FIRST=desc.gate == "first",
        BACKWARD=backward,
        F64=desc.dtype == "f64",
        NB=nb,
        INT64=_needs_int64(layout, halves, (block_r, block_c)),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        EVEN=r % block_r == 0 and c % block_c == 0,
        num_warps=warps,
    )
    if not backward and desc.dtype != "f64":
        # Measured on an H200: ptxas gives the forward 38-40 registers, which caps occupancy at
        # 75%; held to 32 (2 spills at most) it runs 3-7% faster on GeGLU and on transposed
        # inputs, and the same elsewhere.  Backward loses at 32, so it keeps its own allocation.
        meta["maxnreg"] = 32

    return grid, scalars, meta, []  # the last: non-empty once launched (see ``launch``)
