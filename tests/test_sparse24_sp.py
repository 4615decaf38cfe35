"""The CUDA C++ 2:4 linear on the sparse tensor cores (``cuda_sp``) against the fp64 oracle.

The kernel needs a GPU and NVRTC.  On CPU its tiled layout is checked by
emulating the kernel: each lane's loads by the kernel's own pointer
arithmetic, and ``mma.sp`` as PTX defines its fragments and metadata.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.kernels.sparse24_sp import MIN_SLICE_STEPS, SpConfig, _tiled, sp_candidates, sp_config
from kernelplan.kernels.sparse24_ws_rule import k_slices
from test_sparse24_triton import check_backend

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _halves(word: int) -> list[int]:
    return [word & 0xFFFF, (word >> 16) & 0xFFFF]


def emulate_tile(vals: torch.Tensor, meta: torch.Tensor, tile: int, kstep: int, ksteps: int) -> torch.Tensor:
    """The dense ``[16, 64]`` block of W that one warp step of ``kp_sparse24_sp`` multiplies, from the tiled words.

    As the kernel does: lane ``l`` copies the 16 bytes at word ``base * 256
    + 4 l`` (and ``+ 128``) to the same place in shared memory and loads
    ``meta[base * 32 + l]``; ``ldmatrix.x4`` at ``u * 512 + 16 l`` bytes then
    gives lane ``l`` register ``q``: row ``l / 4``, word ``l % 4`` of the 8 x
    16-byte matrix whose row ``r`` lane ``8 q + r`` addressed.  Per PTX's
    ``mma.sp.m16n8k32`` (16-bit types): A register ``i`` of lane (g, t) holds
    compressed columns ``2t, 2t+1`` (+8 for i >= 2) of row ``g`` (+8 for odd
    i); with sparsity selector ``u`` lanes ``t = 2u, 2u + 1`` give the
    metadata, lane ``2u + q`` the 16 compressed columns ``8q ...`` of row ``g``
    in its low half and of row ``g + 8`` in its high half, a group's two
    2-bit indices per nibble, first group lowest.
    """
    base = tile * ksteps + kstep
    w = torch.zeros(16, 64, dtype=torch.float64)
    as_f16 = vals.view(torch.float16)  # two values per word, low half first
    for u in range(2):
        compressed = torch.zeros(16, 16, dtype=torch.float64)
        nibbles = torch.zeros(16, 8, dtype=torch.int64)
        row_address = [base * 256 + 128 * u + 4 * lane for lane in range(32)]  # ldmatrix: a 16-byte row per lane
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i in range(4):
                word = row_address[8 * i + g] + t
                row, col = g + 8 * (i & 1), 2 * t + 8 * (i >> 1)
                compressed[row, col:col + 2] = as_f16[2 * word:2 * word + 2].double()
            if t >> 1 == u:
                q = t & 1
                for h, half in enumerate(_halves(int(meta[base * 32 + lane]) & 0xFFFFFFFF)):
                    for j in range(4):
                        nibbles[g + 8 * h, 4 * q + j] = (half >> 4 * j) & 0xF
        for row in range(16):
            for grp in range(8):
                for slot in range(2):
                    pos = (int(nibbles[row, grp]) >> 2 * slot) & 3
                    w[row, 32 * u + 4 * grp + pos] += compressed[row, 2 * grp + slot]
    return w


@pytest.mark.parametrize("m", [32, 40])  # 40: padded to 48 rows
def test_emulated_kernel_reads_the_weight_back(m, seed):
    k = 192
    w = kp.sparse24.prune(torch.randn(m, k)).half()
    w24 = kp.sparse24.compress(w)
    vals, meta = (t.flatten() for t in _tiled(w24.values, w24.metadata))
    ksteps = k // 64
    dense = torch.zeros(-(-m // 16) * 16, k, dtype=torch.float64)
    for tile in range(dense.shape[0] // 16):
        for s in range(ksteps):
            dense[16 * tile:16 * tile + 16, 64 * s:64 * s + 64] = emulate_tile(vals, meta, tile, s, ksteps)
    assert torch.equal(dense[:m], w.double())
    assert not dense[m:].any()


def test_config_fills_one_wave_with_8_or_16_warps_an_sm_and_the_ring_with_shared_memory():
    assert sp_config(64, 28672, 8192, 132) == SpConfig(8, m_warps=4, k_warps=2, stages=3, min_blocks=2)  # 224 CTAs, 2 an SM
    assert sp_config(32, 28672, 8192, 132) == SpConfig(4, m_warps=4, k_warps=1, stages=6, min_blocks=2)
    assert sp_config(64, 8192, 8192, 132) == SpConfig(8, m_warps=2, k_warps=8, stages=2)  # 128 CTAs of 64 rows
    assert sp_config(32, 8192, 8192, 132) == SpConfig(4, m_warps=2, k_warps=4, stages=6)
    for n in (1, 16, 33, 64):
        for m, k in ((4096, 4096), (28672, 8192), (128256, 4096), (256000, 3584), (152064, 8192)):
            cfg = sp_config(n, m, k, 132)
            assert cfg.stage_bytes == (cfg.k_warps * 8 * cfg.n_tiles * 128
                                       + cfg.m_warps * cfg.k_warps * cfg.row_tiles * 1152)
            # The ring is the deepest (up to 6) that the CTAs an SM holds at once leave room for: the grid's share
            # of an SM where 96 registers a thread allow that many (n <= 16), else as many as they allow.
            per_sm = -(-m // (cfg.rows * 132))
            resident = min(per_sm, 65536 // (96 * cfg.threads)) if n <= 16 else per_sm
            deeper = dataclasses.replace(cfg, stages=cfg.stages + 1)
            assert resident * (cfg.shared + 1024) <= 227 * 1024 or cfg.stages == 2
            assert cfg.stages == 6 or resident * (deeper.shared + 1024) > 227 * 1024
    # 1002 CTAs of 128 rows, 8 an SM where the registers hold 5 (128 threads): a ring for 5, not 2 steps for 8
    assert sp_config(1, 128256, 4096, 132) == SpConfig(1, m_warps=4, k_warps=1, stages=4, min_blocks=4)


def test_config_at_n_up_to_16_takes_32_row_ctas_and_16_warps_an_sm():
    # 112 CTAs of 32 rows: 16 x 132 / (112 x 2) = 9.4 warps a CTA's row of W, so 8 K slices
    assert sp_config(8, 3584, 14336, 132) == SpConfig(1, row_tiles=1, m_warps=2, k_warps=8, stages=6)
    # 576 CTAs of 128 rows are 4 an SM or more: 128 rows, one slice, the ring of 5 CTAs an SM (launch-bound to 4:
    # 16 warps)
    assert sp_config(1, 73728, 4608, 132) == SpConfig(1, m_warps=4, k_warps=1, stages=4, min_blocks=4)
    assert sp_config(16, 35840, 5120, 132) == SpConfig(2, m_warps=2, k_warps=1, stages=6, min_blocks=5)  # 560 of 64
    assert sp_config(1, 4096, 192, 132) == SpConfig(1, row_tiles=1, m_warps=2, k_warps=1, stages=6)  # 3 K steps


def test_k_slices_need_not_divide_ks_steps_but_each_has_two():
    # 128 CTAs of 32 rows want 8 slices; 25 steps run as 3, 3, 3, 3, 3, 3, 3 and 4
    assert sp_config(8, 4096, 1600, 132).k_warps == 8
    assert [len(s) for s in k_slices(1600, 8)] == [3, 3, 3, 3, 3, 3, 3, 4]
    # 12 steps: 4 slices of 3, not 8 of 1 and 2; 5 steps: 2 slices of 2 and 3; 3 steps: one slice
    assert [sp_config(8, 4096, k, 132).k_warps for k in (768, 320, 192, 64)] == [4, 2, 1, 1]
    for n in (1, 16, 64):
        for m, k in ((1000, 64), (4096, 320), (2304, 768), (8192, 29568), (3072, 2240)):
            cfg = sp_config(n, m, k, 132)
            assert cfg.k_warps & (cfg.k_warps - 1) == 0
            assert cfg.k_warps == 1 or min(len(s) for s in k_slices(k, cfg.k_warps)) >= MIN_SLICE_STEPS


def emulate_ctas(cfg: SpConfig, w: torch.Tensor, x: torch.Tensor, gated: bool) -> list[torch.Tensor]:
    """What ``kp_sparse24_sp``'s grid of ``cfg`` writes, from its index arithmetic (``sparse24_sp.cu``): each CTA's
    warps (``mw``, ``kw``) multiply row tile ``tile`` of W over K slice ``kw`` (``step0``, ``mine``: ``k_slices``,
    which the cuda_ws kernel shares) into the reduction buffer at local rows
    ``16 c``, and output column ``m`` of the CTA sums the slices of local row ``ml`` (and ``kOut + ml``, gated).
    Returns the sums per region, ``[N, M / regions]`` each, NaN where no CTA wrote."""
    m, k = w.shape
    regions = 2 if gated else 1
    tiles = -(-m // 16)
    slices, half = k_slices(k, cfg.k_warps), tiles // regions
    padded = torch.nn.functional.pad(w, (0, 0, 0, 16 * tiles - m))
    cta_tiles, rows = cfg.m_warps * cfg.row_tiles // regions, cfg.rows
    k_out, cols = rows // regions, m // regions
    out = [torch.full((x.shape[0], cols), float("nan"), dtype=torch.float64) for _ in range(regions)]
    for b in range(-(-m // rows)):  # the launch's grid (SpKernel.launch_config)
        red = torch.zeros(cfg.k_warps, rows, x.shape[0], dtype=torch.float64)
        for mw in range(cfg.m_warps):
            for kw in range(cfg.k_warps):
                for r in range(cfg.row_tiles):
                    c = mw * cfg.row_tiles + r
                    in_half = b * cta_tiles + c % cta_tiles
                    tile = in_half + c // cta_tiles * half if in_half < half else 0
                    ks = slice(64 * slices[kw].start, 64 * slices[kw].stop)
                    red[kw, 16 * c:16 * c + 16] = padded[16 * tile:16 * tile + 16, ks] @ x[:, ks].T
        for ml in range(k_out):
            col = b * k_out + ml
            if col < cols:
                for h in range(regions):
                    assert out[h][:, col].isnan().all(), f"{cfg}: column {col} written twice"
                    out[h][:, col] = red[:, h * k_out + ml].sum(0)
    return out


@pytest.mark.parametrize("gated", [False, True])
def test_every_candidate_tiles_grid_writes_each_column_once_from_its_rows(gated, seed):
    for n, m, k in ((1, 96, 192), (5, 70, 512), (8, 1056, 1024), (13, 2080, 256), (16, 256, 4096), (40, 544, 512),
                    (3, 96, 320), (9, 160, 704)):  # 5 and 11 steps: slices that do not divide them
        if gated and m % 32:
            continue
        w, x = torch.randn(m, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64)
        want = x @ w.T
        for cfg in sp_candidates(n, m, k, 132):
            got = emulate_ctas(cfg, w, x, gated)
            halves = [want[:, :m // 2], want[:, m // 2:]] if gated else [want]
            for g, h in zip(got, halves):
                torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12, msg=f"{cfg} n={n} {m}x{k}")


HOPPER_SHARED, A100_SHARED, ADA_SHARED = 227 * 1024, 163 * 1024, 99 * 1024  # opt-in shared memory a CTA


def test_every_rule_tile_fits_hoppers_shared_memory_and_is_fitted_to_smaller_gpus():
    from kernelplan.kernels.sparse24_sp import fit_shared, sp_candidates

    cut = 0
    for m, k in sweep_shapes():
        for n in (1, 8, 16, 32, 64):
            for cfg in sp_candidates(n, m, k, 132):
                assert fit_shared(cfg, HOPPER_SHARED) == cfg  # the rules size rings for Hopper: nothing cut
                for limit in (A100_SHARED, ADA_SHARED):
                    fitted = fit_shared(cfg, limit)
                    assert fitted.shared <= limit and fitted.stages >= 2 and fitted.rows == cfg.rows
                    assert fitted.k_warps <= k // 64 and fitted.n_tiles == cfg.n_tiles
                    assert fitted.k_warps < cfg.k_warps or fitted.k_warps == cfg.k_warps and (
                        fitted.stages <= cfg.stages)
                    cut += fitted != cfg
    assert cut  # some rings and K splits are too deep for the A100 or Ada
    # 8192^2 at n = 64: 8 K slices of 2 steps take 200 KiB; the A100 holds 4 slices of 2, Ada 2 slices of 2
    cfg = sp_config(64, 8192, 8192, 132)
    assert (cfg.k_warps, cfg.stages) == (8, 2) and cfg.shared == 204800
    assert (fit_shared(cfg, A100_SHARED).k_warps, fit_shared(cfg, ADA_SHARED).k_warps) == (4, 2)


def test_the_kernel_fits_its_tile_to_the_devices_shared_memory(monkeypatch):
    from kernelplan.kernels import sparse24_sp
    from kernelplan.kernels.sparse24_sp import SpKernel, fit_shared

    monkeypatch.setattr(sparse24_sp, "sm_count", lambda device: 132)
    monkeypatch.setattr(sparse24_sp, "shared_per_block", lambda device: ADA_SHARED)
    assert SpKernel().config(64, 8192, 8192, 0) == fit_shared(sp_config(64, 8192, 8192, 132), ADA_SHARED)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, m, k, activation, bias, layout", [
    (1, 64, 128, None, False, "contiguous"),
    (5, 70, 192, "relu", True, "contiguous"),  # n <= 16: 32-row CTAs, the last one part M
    (13, 1000, 4096, "gelu", True, "strided"),  # n <= 16: 32-row CTAs, K split in 8 slices
    (13, 1000, 1600, "gelu", True, "strided"),  # K of 25 steps in 8 slices of 3 and 4
    (17, 70, 192, "relu", True, "contiguous"),  # M not a multiple of 16 or of the CTA's 64 rows
    (24, 1000, 4096, "gelu", True, "transposed"),  # non-contiguous x: copied
    (33, 256, 1024, "gelu_tanh", True, "strided"),  # five N tiles of eight staged
    (64, 4096, 4096, "silu", False, "contiguous"),  # K split in 8 slices
    (40, 28672 // 4, 512, None, True, "contiguous"),
])
def test_cuda_sp_matches_fp64(n, m, k, activation, bias, layout, dtype, seed):
    check_backend("cuda_sp", n, m, k, activation, bias, layout, dtype)


# 3-D and misaligned x, strided y, too many rows, graph replay, dispatch and refusals:
# tests/test_sparse24_mma.py, for both tiled kernels.


@gpu
@needs_cuda
@pytest.mark.parametrize("n, m, k", [(8, 1000, 1600), (40, 272, 704), (3, 96, 192)])
def test_every_candidate_tile_matches_fp64_where_k_slices_do_not_divide_ks_steps(n, m, k, seed):
    """K of 25, 11 and 3 steps, in every tile ``sp_candidates`` gives (1 to 8 slices), each fitted to the device's
    shared memory as it would run: slices a step apart sum to the whole of K."""
    from helpers import FWD_ATOL, assert_close, poisoned
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_sp import SpKernel
    from test_sparse24_wg import _tiled_problem

    w, x, b, run = _tiled_problem(n, m, k)
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    cands = sp_candidates(n, m, k, sm_count(0))
    assert any((k // 64) % c.k_warps for c in cands)
    for cfg in cands:
        y = poisoned((n, m), torch.bfloat16, "cuda")
        run(*SpKernel().launch_config(cfg, n, m, "bf16", True, "gelu", 0), y)
        assert_close(y, ref, F.gelu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16], what=str(cfg))
