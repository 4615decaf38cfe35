"""The Hopper ``wgmma.sp`` 2:4 linears against the fp64 oracle: ``cuda_wg`` (its configuration rule on CPU here) and
the warp-specialized ``cuda_ws`` (its own CPU tests in test_sparse24_ws.py), one GPU test body for both.

They read ``cuda_sp``'s layout: the layout's own tests are in test_sparse24_sp.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned, sm90
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_sp import SM_SHARED, SP_LAYOUT
from kernelplan.kernels.sparse24_wg import INSTRUCTION_N, WgKernel, tile_cost, wg_candidates, wg_config
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import ws_candidates
from test_sparse24_triton import check_backend

gpu = pytest.mark.gpu


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_config_rule_fits_every_sweep_shape_and_batch(sms):
    for (m, k) in sweep_shapes():
        for n in BATCH_SIZES + (3, 33, 200, 1000):
            cfg = wg_config(n, m, k, sms)
            assert cfg in wg_candidates(n, m, k)
            assert cfg.shared * cfg.min_blocks <= SM_SHARED, (n, m, k, cfg)
            assert cfg.bn % cfg.ni == 0 and cfg.ni in INSTRUCTION_N and cfg.bn <= 256 and cfg.bn % cfg.kc == 0
            assert (k // 64) % cfg.slices == 0 and cfg.threads <= 1024
            assert cfg.stages >= 3 and cfg.stage_bytes % 1024 == 0


def test_config_rule_is_the_least_cost_candidate_and_matches_the_measured_table():
    """The rule against the tiles it was fitted on: within 0.9x of the best tile on average, and never a tile
    that fills less than half the SMs where one that fills them exists."""
    import json
    import pathlib
    import re
    import statistics

    data = json.loads((pathlib.Path(__file__).parents[1] / "bench/results/sparse24-wg-tiles-h100.json").read_text())
    sms = data["meta"]["sms"]
    ratios = []
    for row in data["rows"]:
        n, m, k, times = row["n"], row["m"], row["k"], row["tiles_ms"]
        cfg = wg_config(n, m, k, sms)
        assert cfg == min(wg_candidates(n, m, k), key=lambda c: tile_cost(c, n, m, sms))
        by_fields = {tuple(int(v) for v in re.findall(r"=(\d+)", name)): t for name, t in times.items()}
        ratios.append(min(times.values()) / by_fields[(cfg.bn, cfg.ni, cfg.wm, cfg.ks, cfg.kc, cfg.stages, cfg.sub,
                                                       cfg.min_blocks)])
    assert statistics.mean(ratios) >= 0.9 and statistics.median(ratios) >= 0.93, statistics.mean(ratios)


def test_cluster_k_split_and_tall_tiles_are_candidates_only_where_they_fit():
    cands = wg_candidates(256, 4096, 4096)
    assert {c.kc for c in cands} == {1, 2, 4, 8} and {c.wm for c in cands} == {1, 2, 4}
    assert all(c.bn <= 128 and c.ks == 1 for c in cands if c.wm == 4)  # 512 threads: 128 registers each
    assert {(c.ks, c.kc) for c in wg_candidates(256, 4096, 64)} == {(1, 1)}  # one K step: no split


@pytest.mark.parametrize("n, m, k", [(200, 1000, 2048), (77, 520, 1024), (300, 260, 4096)])
def test_candidate_space_of_the_gpu_test_shapes(n, m, k):
    """The shapes test_every_candidate_tile_matches_fp64 runs reach K slices in a CTA and across a cluster."""
    cands = wg_candidates(n, m, k)
    assert {c.kc for c in cands} >= {1, 2, 4} and {c.ks for c in cands} == {1, 2}


def test_cuda_wg_shares_cuda_sp_layout():
    from kernelplan.kernels.sparse24_sp import SpKernel

    assert WgKernel.layout == SpKernel.layout == SP_LAYOUT


CASES = [  # (n, m, k, activation, bias, layout)
    (1, 4096, 4096, None, False, "contiguous"),
    (17, 4096, 4096, None, False, "contiguous"),
    (33, 200, 512, "gelu", True, "transposed"),  # odd M (past a 16-row tile), odd N
    (64, 3584, 3584, None, True, "contiguous"),  # Qwen2.5-7B o_proj, K = 56 steps
    (130, 1000, 1024, "silu", False, "strided"),
    (200, 768, 3072, "relu", True, "contiguous"),
    (256, 8192, 1024, "gelu_tanh", False, "contiguous"),
    (777, 2304, 768, None, True, "contiguous"),
    (4096, 1024, 4096, None, False, "contiguous"),
    (8191, 640, 256, "gelu", True, "contiguous"),
]
KERNELS = {"cuda_wg": WgKernel, "cuda_ws": WsKernel}


@gpu
@sm90
@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, m, k, activation, bias, layout", CASES,
                         ids=[f"n{c[0]}-m{c[1]}-k{c[2]}-{c[3]}-{c[5]}" for c in CASES])
def test_wgmma_kernels_match_fp64(backend, n, m, k, activation, bias, layout, dtype, seed):
    check_backend(backend, n, m, k, activation, bias, layout, dtype)


@gpu
@sm90
@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
def test_3d_x_strided_y_and_graph_replay(kernel, seed):
    w = kp.sparse24.prune(torch.randn(520, 1024, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    b = torch.randn(520, device="cuda").bfloat16()
    x = torch.randn(3, 100, 1025, device="cuda").bfloat16()[..., 1:]  # 3-D, rows off 16-byte alignment
    call = MmaLinear("silu", kernel())
    ref = F.silu(F.linear(x.double(), w.double(), b.double()))
    assert_close(call(x, w24.values, w24.metadata, b), ref, F.silu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16])
    x2 = x.reshape(300, 1024).contiguous()
    y = poisoned((520, 300), torch.bfloat16, "cuda").t()  # y strided along M: written through a copy
    call.launch(x2, w24.values, w24.metadata, b, y)
    assert_close(y, ref.reshape(300, 520), F.silu(F.linear(x2, w, b)), atol=FWD_ATOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = call(x2, w24.values, w24.metadata, b)
    x2.copy_(torch.randn_like(x2))  # the same address: the graph reads the new values (cuda_ws: its tensor map)
    graph.replay()
    assert_close(yg, F.silu(F.linear(x2.double(), w.double(), b.double())), F.silu(F.linear(x2, w, b)),
                 atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
def test_wgmma_kernels_and_cuda_sp_hold_one_layout(kernel, seed):
    """Calls at n = 1, 64, 256 and 4096 through cuda_sp and a wgmma kernel keep one copy: 0.5625x dense."""
    from kernelplan.kernels.sparse24_sp import SpKernel

    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(4096, 4096, device="cuda")).bfloat16())
    for n, k in ((1, SpKernel), (64, SpKernel), (64, kernel), (256, kernel), (4096, kernel)):
        MmaLinear(None, k())(torch.randn(n, 4096, device="cuda").bfloat16(), w24.values, w24.metadata, None)
    derived = w24.derived_bytes()
    assert derived[SP_LAYOUT] == 4096 * 4096 * 2 * 9 // 16
    assert sum(derived.values()) == derived[SP_LAYOUT], derived  # the launches hold no copy of their own


CANDIDATE_CASES = [("cuda_wg", 200, 1000, 2048), ("cuda_wg", 77, 520, 1024), ("cuda_wg", 300, 260, 4096),
                   ("cuda_ws", 200, 1000, 2048), ("cuda_ws", 77, 528, 1024), ("cuda_ws", 300, 272, 4096),
                   ("cuda_ws", 256, 4096, 1024), ("cuda_ws", 90, 400, 1600), ("cuda_ws", 8, 400, 1600)]


def _tiled_problem(n, m, k):
    """A bf16 2:4 weight [m, k] in the one layout, x [n, k] and a bias; ``run(launch, grid, y)`` launches a kernel
    variant on them into y."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24_sp import _tiled

    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    pairs, codes = _tiled(w24.values, w24.metadata)
    b = torch.randn(m, device="cuda").bfloat16()
    x = torch.randn(n, k, device="cuda").bfloat16()

    def run(launch, grid, y):
        launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, k,
                      x.stride(0), y.stride(0)), raw_stream(0))

    return w, x, b, run


@gpu
@sm90
@pytest.mark.parametrize("backend, n, m, k", CANDIDATE_CASES)
def test_every_candidate_tile_matches_fp64(backend, n, m, k, seed):
    """Each tile a rule may pick (N tiles of every size, row blocks, K slices in a CTA and across a cluster, x
    shared along M) is right, rows of W past M included."""
    w, x, b, run = _tiled_problem(n, m, k)
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    kernel = KERNELS[backend]()
    for cfg in {"cuda_wg": wg_candidates, "cuda_ws": functools.partial(ws_candidates, between=True)}[backend](n, m, k):
        y = poisoned((n, m), torch.bfloat16, "cuda")
        run(*kernel.launch_config(cfg, n, m, "bf16", True, "gelu", 0), y)
        assert_close(y, ref, F.gelu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16], what=str(cfg))


@gpu
@sm90
@pytest.mark.parametrize("kind", ["whole waves", "waves then split", "all split", "tiny K"])
def test_persistent_split_kernel_matches_fp64_deterministically(kind, seed):
    """The persistent variant: whole tiles in waves, the tail's tiles split along K and handed over between CTAs,
    or both; the same bits on every call (the parts are added in a fixed order) and from a CUDA graph replay."""
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_ws_rule import WsConfig, sk_plan

    sms = sm_count(0)
    cfg = WsConfig(64, 1, stages=8, sk=True)
    n, m, k = {"whole waves": (128, 64 * sms, 1024), "waves then split": (190, 64 * (sms + 7) - 5, 1024),
               "all split": (77, 520, 4096), "tiny K": (60, 1000, 576)}[kind]
    plan = sk_plan(cfg, n, m, k, sms)
    assert (plan.splits == 1) == (kind == "whole waves"), plan
    w, x, b, run = _tiled_problem(n, m, k)
    ref = F.silu(F.linear(x.double(), w.double(), b.double()))
    launch = WsKernel().launch_config(cfg, n, m, "bf16", True, "silu", 0)
    outs = []
    for _ in range(3):
        y = poisoned((n, m), torch.bfloat16, "cuda")
        run(*launch, y)
        outs.append(y)
    assert_close(outs[0], ref, F.silu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16], what=kind)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    yg = poisoned((n, m), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*launch, yg)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, outs[0])


@gpu
@sm90
@pytest.mark.parametrize("bn, wm", [(48, 1), (64, 1), (128, 1), (128, 2), (256, 1)])
@pytest.mark.parametrize("kind", ["fewer tiles than SMs", "several tiles a CTA, odd count", "odd M and N, tiny K",
                                  "several tiles a CTA, K under the ring", "rows of y misaligned"])
def test_ping_pong_kernel_matches_fp64(bn, wm, kind, seed):
    """The persistent ping-pong variant: each consumer warpgroup its own tiles, in turn (one tile a CTA, several,
    an odd number so one warpgroup gets one more, K shorter than the ring), rows of W and x past M and N, y written
    through the staging buffer with and without 16-byte rows; bias and an activation; the same bits from a CUDA
    graph replay."""
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_ws_rule import _deepest

    sms = sm_count(0)
    cfg = _deepest(bn, wm, 1, 1, pp=True)
    rows = 64 * wm
    n, m, k = {"fewer tiles than SMs": (bn, rows * (sms // 2), 1024),
               "several tiles a CTA, odd count": (3 * bn, rows * sms + rows, 576),
               "odd M and N, tiny K": (bn * 2 + 5, rows * 7 - 3, 64 * 3),
               # K shorter than the ring: a CTA's next tile starts part way round it.
               "several tiles a CTA, K under the ring": (3 * bn, rows * sms + rows, 64 * 3),
               "rows of y misaligned": (bn + 9, rows * 3 + 4, 512)}[kind]
    w, x, b, run = _tiled_problem(n, m, k)
    ref = F.silu(F.linear(x.double(), w.double(), b.double()))
    launch = WsKernel().launch_config(cfg, n, m, "bf16", True, "silu", 0)
    y = poisoned((n, m), torch.bfloat16, "cuda")
    run(*launch, y)
    assert_close(y, ref, F.silu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16], what=f"{cfg} {kind}")
    yg = poisoned((n, m), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*launch, yg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
