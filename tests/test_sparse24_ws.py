"""The warp-specialized Hopper ``wgmma.sp`` 2:4 linear (``cuda_ws``) against the fp64 oracle; its tile rule on CPU.

It reads the one device layout: the layout's own tests are in test_sparse24_layout.py and test_sparse24_sp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_sp import SM_SHARED, SP_LAYOUT
from kernelplan.kernels.sparse24_wg import INSTRUCTION_N
from kernelplan.kernels.sparse24_ws import WsConfig, WsKernel, tile_cost, ws_candidates, ws_config
from test_sparse24_triton import check_backend

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 (Hopper) GPU")
gpu = pytest.mark.gpu


@pytest.mark.parametrize("sms", [78, 114, 132])
def test_tile_rule_fits_every_sweep_shape_and_batch(sms):
    for (m, k) in sweep_shapes():
        for n in BATCH_SIZES + (3, 33, 200, 1000):
            cfg = ws_config(n, m, k, sms)
            cands = ws_candidates(n, m, k)
            assert cfg == min(cands, key=lambda c: tile_cost(c, n, m, k, sms))
            assert cfg.shared <= SM_SHARED and cfg.stages >= 3 and cfg.stage_bytes % 1024 == 0, (n, m, k, cfg)
            assert cfg.bn <= 256 and cfg.bn % 8 == 0 and cfg.bn % cfg.ni == 0 and cfg.ni in INSTRUCTION_N
            assert (k // 64) % cfg.kc == 0 and cfg.bn % (8 * cfg.kc) == 0 and cfg.threads == 128 * (cfg.wm + 1)
            assert cfg.bn % (8 * cfg.cm) == 0 and cfg.cm * cfg.kc <= 8


def test_shared_memory_holds_the_ring_the_partial_sums_and_the_barriers():
    cfg = WsConfig(bn=256, wm=2, stages=5)
    assert cfg.stage_bytes == 32768 + 8 * 1152 == 41 * 1024  # x's 256 rows of 128 bytes, 8 tiles of W
    assert cfg.shared == 5 * 41 * 1024 + 16 * 5 + 1024
    wide = WsConfig(bn=256, wm=2, stages=3)  # the partial sums [256][132] f32 exceed a 3-step ring
    assert wide.shared == 256 * 132 * 4 + 16 * 3 + 1024


def test_m_groups_need_as_many_row_tiles():
    assert {c.cm for c in ws_candidates(256, 4096, 4096)} == {1, 2, 4}
    assert {c.cm for c in ws_candidates(256, 128, 4096) if c.wm == 2} == {1}  # one 128-row tile
    assert {c.cm for c in ws_candidates(256, 128, 4096) if c.wm == 1} == {1, 2}


def test_k_split_only_where_each_cta_keeps_four_steps():
    assert {c.kc for c in ws_candidates(256, 4096, 4096)} == {1, 2, 4}
    assert {c.kc for c in ws_candidates(256, 4096, 256)} == {1}  # 4 steps: no split
    assert {c.kc for c in ws_candidates(256, 4096, 64 * 6)} == {1}  # 6 steps: 2 x 3 would leave 3 a CTA


def test_cuda_ws_reads_the_one_layout():
    from kernelplan.kernels.sparse24_sp import SpKernel

    assert WsKernel.layout == SpKernel.layout == SP_LAYOUT and WsKernel.architecture == "sm_90a"


def test_every_variant_compiles_for_sm90a():
    """NVRTC builds every tile, dtype and epilogue of the kernel on a CPU machine (no GPU needed)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from kernelplan.kernels import nvrtc
    from kernelplan.kernels.sparse24_ws import source

    try:
        nvrtc._nvrtc_version(__import__("cuda.bindings.nvrtc", fromlist=["nvrtcVersion"]))
    except Exception as e:  # no NVRTC library next to the bindings
        pytest.skip(f"NVRTC is not loadable here: {e}")
    cfgs = {WsConfig(256, 2, 2, 1, 5), WsConfig(64, 1, 1, 4, 8), WsConfig(96, 2, 1, 2, 8), WsConfig(128, 1, 4, 2, 8)}
    for cfg, dtype, bias, act in [(c, d, b, a) for c in cfgs for d, b, a in (("bf16", True, "gelu"),
                                                                          ("f16", False, None))]:
        assert len(nvrtc._compile(__import__("cuda.bindings.nvrtc", fromlist=["x"]),
                                  source(cfg, dtype, bias, act), "sm_90a")) > 0


CASES = [  # (n, m, k, activation, bias, layout)
    (17, 4096, 4096, None, False, "contiguous"),
    (33, 200, 512, "gelu", True, "transposed"),  # M past a 16-row tile, odd N
    (64, 3584, 3584, None, True, "contiguous"),  # K = 56 steps
    (130, 1000, 1024, "silu", False, "strided"),
    (200, 768, 3072, "relu", True, "contiguous"),
    (256, 8192, 1024, "gelu_tanh", False, "contiguous"),
    (777, 2304, 768, None, True, "contiguous"),
    (4096, 1024, 4096, None, False, "contiguous"),
    (8191, 640, 256, "gelu", True, "contiguous"),
]


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, m, k, activation, bias, layout", CASES,
                         ids=[f"n{c[0]}-m{c[1]}-k{c[2]}-{c[3]}-{c[5]}" for c in CASES])
def test_cuda_ws_matches_fp64(n, m, k, activation, bias, layout, dtype, seed):
    check_backend("cuda_ws", n, m, k, activation, bias, layout, dtype)


@gpu
@sm90
def test_cuda_ws_3d_x_strided_y_and_graph_replay(seed):
    w = kp.sparse24.prune(torch.randn(520, 1024, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    b = torch.randn(520, device="cuda").bfloat16()
    x = torch.randn(3, 100, 1025, device="cuda").bfloat16()[..., 1:]  # 3-D, rows off 16-byte alignment
    call = MmaLinear("silu", WsKernel())
    ref = F.silu(F.linear(x.double(), w.double(), b.double()))
    assert_close(call(x, w24.values, w24.metadata, b), ref, F.silu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16])
    x2 = x.reshape(300, 1024).contiguous()
    y = poisoned((520, 300), torch.bfloat16, "cuda").t()  # y strided along M: written through a copy
    call.launch(x2, w24.values, w24.metadata, b, y)
    assert_close(y, ref.reshape(300, 520), F.silu(F.linear(x2, w, b)), atol=FWD_ATOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = call(x2, w24.values, w24.metadata, b)
    x2.copy_(torch.randn_like(x2))  # the same address: the graph's tensor map reads the new values
    graph.replay()
    assert_close(yg, F.silu(F.linear(x2.double(), w.double(), b.double())), F.silu(F.linear(x2, w, b)),
                 atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
def test_tensor_maps_follow_x_between_calls(seed):
    """Calls with x at new addresses and new N (each its own tensor map) and back at an old one stay right."""
    w = kp.sparse24.prune(torch.randn(384, 512, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    call = MmaLinear(None, WsKernel())
    xs = [torch.randn(n, 512, device="cuda").bfloat16() for n in (40, 40, 300, 41)]
    for x in xs + xs[:1]:
        assert_close(call(x, w24.values, w24.metadata, None), F.linear(x.double(), w.double()), F.linear(x, w),
                     atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
def test_cuda_ws_holds_no_copy_of_its_own(seed):
    """Calls at n = 1, 64, 256 and 4096 beside cuda_sp keep one copy of the layout: 0.5625x dense."""
    from kernelplan.kernels.sparse24_sp import SpKernel

    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(4096, 4096, device="cuda")).bfloat16())
    for n, kernel in ((1, SpKernel), (64, WsKernel), (256, WsKernel), (4096, WsKernel)):
        MmaLinear(None, kernel())(torch.randn(n, 4096, device="cuda").bfloat16(), w24.values, w24.metadata, None)
    derived = w24.derived_bytes()
    assert derived[SP_LAYOUT] == 4096 * 4096 * 2 * 9 // 16
    assert sum(derived.values()) == derived[SP_LAYOUT], derived


@gpu
@sm90
@pytest.mark.parametrize("n, m, k", [(200, 1000, 2048), (77, 528, 1024), (300, 272, 4096), (256, 4096, 1024)])
def test_every_candidate_tile_matches_fp64(n, m, k, seed):
    """Each tile the rule may pick (N tiles, 64- and 128-row CTAs, x shared by 2 or 4 CTAs along M, K split across
    a cluster, both at once) is right, rows of W past M included."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24_sp import _tiled

    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    pairs, codes = _tiled(w24.values, w24.metadata)
    b = torch.randn(m, device="cuda").bfloat16()
    x = torch.randn(n, k, device="cuda").bfloat16()
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    cands = ws_candidates(n, m, k)
    assert {c.kc for c in cands} >= {1, 2, 4} and {c.wm for c in cands} == {1, 2} and {c.cm for c in cands} == {1, 2, 4}
    assert any(c.cm > 1 and c.kc > 1 for c in cands)
    for cfg in cands:
        launch, grid = WsKernel().launch_config(cfg, n, m, "bf16", True, "gelu", 0)
        y = poisoned((n, m), torch.bfloat16, "cuda")
        launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, k,
                      x.stride(0), y.stride(0)), raw_stream(0))
        assert_close(y, ref, F.gelu(F.linear(x, w, b)), atol=FWD_ATOL[torch.bfloat16], what=str(cfg))


def test_tile_rule_matches_the_measured_table():
    """The rule against the tiles it was fitted on: within 0.95x of the best tile on average and never below 0.7x."""
    import json
    import pathlib
    import statistics

    data = json.loads((pathlib.Path(__file__).parents[1] / "bench/results/sparse24-ws-tiles-h100.json").read_text())
    sms = data["meta"]["sms"]
    ratios = []
    for row in data["rows"]:
        times = row["tiles_ms"]
        cfg = ws_config(row["n"], row["m"], row["k"], sms)
        ratios.append(min(times.values()) / times[str(cfg)])
    assert statistics.mean(ratios) >= 0.95 and min(ratios) >= 0.7, (statistics.mean(ratios), min(ratios))
