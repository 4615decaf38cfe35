"""The warp-specialized Hopper ``wgmma.sp`` 2:4 linear (``cuda_ws``): its tile rule on CPU, its tensor maps on a GPU.

Its fp64 tests share one body with ``cuda_wg``'s in test_sparse24_wg.py; the layout's own tests are in
test_sparse24_layout.py and test_sparse24_sp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_sp import SM_SHARED, SP_LAYOUT
from kernelplan.kernels.sparse24_wg import INSTRUCTION_N
from kernelplan.kernels.sparse24_ws import WsConfig, WsKernel, tile_cost, ws_candidates, ws_config

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
    nvrtc_bindings = pytest.importorskip("cuda.bindings.nvrtc")
    from kernelplan.kernels import nvrtc
    from kernelplan.kernels.sparse24_ws import source

    try:
        nvrtc._nvrtc_version(nvrtc_bindings)
    except Exception as e:  # no NVRTC library next to the bindings
        pytest.skip(f"NVRTC is not loadable here: {e}")
    cfgs = {WsConfig(256, 2, 2, 1, 5), WsConfig(64, 1, 1, 4, 8), WsConfig(96, 2, 1, 2, 8), WsConfig(128, 1, 4, 2, 8)}
    for cfg in cfgs:
        for dtype, bias, act in (("bf16", True, "gelu"), ("f16", False, None)):
            assert len(nvrtc._compile(nvrtc_bindings, source(cfg, dtype, bias, act), "sm_90a")) > 0


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



@pytest.mark.parametrize("n, m, k", [(200, 1000, 2048), (77, 528, 1024), (300, 272, 4096), (256, 4096, 1024)])
def test_candidate_space_of_the_gpu_test_shapes(n, m, k):
    """The shapes test_sparse24_wg.py's every-candidate GPU test runs reach every kind of tile, clusters of both."""
    cands = ws_candidates(n, m, k)
    assert {c.kc for c in cands} >= {1, 2, 4} and {c.wm for c in cands} == {1, 2} and {c.cm for c in cands} == {1, 2, 4}
    assert any(c.cm > 1 and c.kc > 1 for c in cands)


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
