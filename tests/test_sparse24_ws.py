"""The warp-specialized Hopper ``wgmma.sp`` 2:4 linear (``cuda_ws``): its kernels' index arithmetic emulated and their
SASS read on CPU, their results against fp64 and their tensor maps on a GPU.  The tile rule's own tests are in
test_sparse24_ws_rule.py.

Its fp64 tests share one body with ``cuda_wg``'s in test_sparse24_wg.py; the layout's own tests are in
test_sparse24_layout.py and test_sparse24_sp.py.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, sm90
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_sp import SM_SHARED, SP_LAYOUT
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import WsConfig, ws_candidates, ws_config
from kernelplan.sparse24.dispatch import wide_weight

gpu = pytest.mark.gpu


@pytest.mark.parametrize("tiles_n, groups", [(1, 1), (1, 37), (32, 224), (7, 9), (3, 8), (5, 17), (16, 3)])
def test_the_grid_runs_its_tiles_in_bands_where_x_is_large_each_once(tiles_n, groups):
    """The one-a-tile grid's launch order (``band_order``, the kernel's ``band_tile``): every (tile of x, M group)
    once; where x is large, a wave of 132 CTAs on as few tiles of x and groups as a band gives, where the grid's own
    order (x fastest, kept for smaller x) took every tile of x for a few groups."""
    import pathlib

    from kernelplan.kernels import sparse24_ws_rule

    cu = (pathlib.Path(sparse24_ws_rule.__file__).parent / "cuda" / "sparse24_ws.cu").read_text()
    assert f"#define KP_BAND {sparse24_ws_rule.BAND}\n" in cu  # the mirror's band is the kernel's
    assert f"#define KP_BAND_MIN_X ({sparse24_ws_rule.BAND_MIN_X >> 20} << 20)\n" in cu
    k = 8192
    band_min_x, band_order = sparse24_ws_rule.BAND_MIN_X, sparse24_ws_rule.band_order
    small, large = band_min_x // (2 * k) - 1, band_min_x // (2 * k)
    every = sorted((t, g) for t in range(tiles_n) for g in range(groups))
    assert band_order(small, k, tiles_n, groups) == [(t, g) for g in range(groups) for t in range(tiles_n)]
    order = band_order(large, k, tiles_n, groups)
    assert sorted(order) == every
    wave, band = order[:132], min(sparse24_ws_rule.BAND, groups)
    assert len({t for t, _ in wave}) == min(tiles_n, -(-len(wave) // band))
    if tiles_n == 32 and groups == 224:  # n = 8192 in tiles of 256, 57344 rows in clusters of 2 x 128
        assert len({t for t, _ in wave}) == 17 and len({g for _, g in wave}) == 8  # own order: all 32 x 5 groups


@gpu
@sm90
def test_a_grid_in_bands_matches_fp64(seed):
    """x of 24 MiB and more runs the grid in bands (``band_tile``): tiles of one CTA a tile, with and without x's
    multicast and K's split, against fp64, bias and an activation included."""
    from kernelplan.kernels.sparse24_ws_rule import BAND_MIN_X, _deepest

    k = 4096
    n = -(-BAND_MIN_X // (2 * k)) + 27  # 3099 rows: past the bound, not a multiple of any tile
    cfgs = [_deepest(240, 2, 1, 1), _deepest(256, 2, 2, 1), _deepest(128, 2, 2, 2), _deepest(96, 3, 1, 1)]
    _launch_against_fp64(cfgs, n, 1040, k)


def _launch_against_fp64(cfgs, n: int, m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Each of ``cfgs`` launched as it is on x [n, k] and a pruned W [m, k] of ``dtype``, bias and GELU, y first all
    NaN (a row no CTA wrote fails), against fp64."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24_sp import _tiled

    x = torch.randn(n, k, device="cuda").to(dtype)
    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).to(dtype)
    bias = torch.randn(m, device="cuda").to(dtype)
    w24 = kp.sparse24.compress(w)
    values, codes = _tiled(w24.values, w24.metadata)
    want = F.gelu(F.linear(x.double(), w.double(), bias.double()))
    for cfg in cfgs:
        y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
        launch, grid = WsKernel().launch_config(cfg, n, m, {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype], True,
                                                "gelu", 0)
        launch(grid, (x.data_ptr(), values.data_ptr(), codes.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                      x.stride(0), y.stride(0)), raw_stream(0))
        assert_close(y, want, F.gelu(F.linear(x, w, bias)), atol=FWD_ATOL[dtype], what=str(cfg))


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_small_n_runs_the_k_split_tiles_against_fp64(dtype, seed):
    """At n <= 16 cuda_ws's K-split tiles the rule picks, through Sparse24Linear and kp.sparse24.linear: 32 rows of x
    with K over a cluster of 4 CTAs, of one 64-row block of W (1000 and 768 rows), and 24 rows with K over 3 of one
    block (2000 rows; 800, a small grid's split: 0064) and of two (4500 rows, K of 25 steps: slices of 8, 8 and 9):
    rows of y written by each CTA of the cluster, M off the 64-row block, odd n, 3-D and transposed x, bias, an
    activation, graph replay, against fp64."""
    from kernelplan.kernels.sparse24_ws_rule import _deepest
    from test_sparse24_tiles import _tile_of_last_launch

    for m, k, (bn, wm, kc) in ((1000, 4096, (32, 1, 4)), (768, 3072, (32, 1, 4)), (2000, 2048, (24, 1, 3)),
                               (4500, 1600, (24, 2, 3)), (800, 768, (24, 1, 3))):
        layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, device="cuda", dtype=dtype))
        w, b = layer.to_dense().double(), layer.bias.detach().double()

        def check(y, x, what, act=lambda t: t):
            assert_close(y, act(F.linear(x.double(), w, b)), act(F.linear(x, w.to(dtype), b.to(dtype))),
                         atol=FWD_ATOL[dtype], what=f"{m}x{k} {what}")

        with torch.no_grad():
            for n in (1, 5, 8, 9, 16):
                x = torch.randn(n, k, device="cuda", dtype=dtype)
                check(layer(x), x, f"n = {n}")
            check(kp.sparse24.linear(x, layer.weight24, layer.bias, "gelu"), x, "gelu", F.gelu)
            x3 = torch.randn(2, 7, k + 8, device="cuda", dtype=dtype)[..., 8:]
            xt = torch.randn(k, 13, device="cuda", dtype=dtype).t()
            for x in (x3, xt):
                check(layer(x), x, f"x of {tuple(x.shape)}")
            # 1000 rows are held public, their tiled layout derived beside them: found by the weight's shape.
            assert _tile_of_last_launch(layer, by_shape=True) == {str(_deepest(bn, wm, 1, kc))}
            xg, yg = _graph_replayed(layer, 11, dtype)
        check(yg, xg, "graph replay")


def _graph_replayed(layer, rows: int, dtype):
    """``layer`` on x of ``rows`` rows, captured in a CUDA graph after a first call and replayed on new x: (x, y)."""
    xg = torch.randn(rows, layer.in_features, device="cuda", dtype=dtype)
    layer(xg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        yg = layer(xg)
    xg.copy_(torch.randn_like(xg))
    graph.replay()
    return xg, yg


@gpu
@sm90
@pytest.mark.parametrize("n", [1, 7, 16])
def test_every_small_n_split_tile_matches_fp64(n, seed):
    """Each tile of small_n_splits (K over 4 CTAs with 32 rows of x, over 3 with 24; one and two 64-row blocks of W),
    launched as it is, whichever the rule picks: M off the blocks, K whose steps the slices do not divide (25 steps:
    6, 6, 6, 7 and 8, 8, 9), bias and an activation, against fp64.  y starts as NaN: a row no slice wrote fails."""
    from kernelplan.kernels.sparse24_ws_rule import small_n_splits

    cfgs = small_n_splits(n, 1600)
    assert {(c.bn, c.kc, c.wm) for c in cfgs} == {(32, 4, 1), (32, 4, 2), (24, 3, 1), (24, 3, 2)}
    _launch_against_fp64(cfgs, n, 1000, 1600)


def test_cuda_ws_reads_the_one_layout():
    from kernelplan.kernels.sparse24_sp import SpKernel

    assert WsKernel.layout == SpKernel.layout == SP_LAYOUT and WsKernel.architecture == "sm_90a"


def test_every_variant_compiles_for_sm90a(compile_for):
    """NVRTC builds every kind of tile (clusters along M and K, ping-pong, split), dtype and epilogue of the kernel
    on a CPU machine (no GPU needed)."""
    from kernelplan.kernels.sparse24_ws import source

    cfgs = {WsConfig(256, 2, 2, 1, 5), WsConfig(64, 1, 1, 4, 8), WsConfig(96, 2, 1, 2, 8), WsConfig(128, 1, 4, 2, 8),
            WsConfig(128, 2, stages=6, pp=True), WsConfig(48, 1, stages=8, pp=True), WsConfig(256, 2, stages=5, sk=True),
            WsConfig(192, 3, 2, 1, 5), WsConfig(64, 3, stages=7, pp=True),
            WsConfig(32, 2, 1, 4, 8),  # the small-n split of two blocks (docs/design/0061)
            WsConfig(24, 2, 1, 3, 8),  # ... over 3 CTAs (0063)
            WsConfig(128, 3, 2, 2, 7), WsConfig(64, 3, 1, 4, 8)}  # 192 rows of W splitting K (0067)
    # Each tile once, the dtypes and epilogues taken in turn (a compile takes seconds on CI's two cores).
    variants = itertools.cycle((("bf16", True, "gelu"), ("f16", False, None)))
    for cfg, (dtype, bias, act) in zip(sorted(cfgs, key=str), variants):
        assert len(compile_for(source(cfg, dtype, bias, act), "sm_90a")) > 0


def test_the_benches_builds_compile(compile_for):
    """The builds bench/sparse24_phases.py and the feed probe make (the phase stamps, KP_PROBE 3; the copies and the
    MMAs alone, 1 and 2; the cluster's sync before the K loop where K is split, KP_LOCAL_SYNC=0; the producer's loop
    on warp 0, KP_WARP_PRODUCER=1; the sums met through the cluster's loads, KP_PUSH_SUMS=0; y staged in f32 where K
    is whole, KP_Y16=0; the ping-pong kernel's phase stamps) compile."""
    from kernelplan.kernels.sparse24_ws import source

    plain = WsConfig(16, 2, 1, 2, 8)
    for head in ("#define KP_PROBE 3\n", "#define KP_PROBE 1\n", "#define KP_PROBE 2\n", "#define KP_LOCAL_SYNC 0\n",
                 "#define KP_WARP_PRODUCER 1\n", "#define KP_PUSH_SUMS 0\n"):
        assert len(compile_for(head + source(plain, "bf16", False, None), "sm_90a")) > 0
    assert len(compile_for("#define KP_Y16 0\n" + source(WsConfig(64, 2, 1, 1, 8), "bf16", True, "gelu"), "sm_90a"))
    assert len(compile_for("#define KP_PROBE 3\n" + source(WsConfig(128, 2, stages=6, pp=True), "bf16", False, None),
                           "sm_90a"))  # the ping-pong kernel's marks


def test_y_is_staged_in_16_bits_where_k_is_whole_and_no_gated_pair_meets(compile_for):
    """A tile with K whole rounds each warpgroup's results to 16 bits and stages them through stmatrix (STSM in the
    SASS), multicast or not; the ping-pong tile always did.  A K split stages f32 sums (its slices add them before
    rounding), and so does a gated tile (a pair's two rows are in two warpgroups), and the KP_Y16=0 build for the A/B.
    Erf's gelu at 192 rows of x and more does too: in 16 bits it spilled.  No variant here spills (STL)."""
    from kernelplan.kernels.sparse24_ws import source
    from kernelplan.kernels.sparse24_ws_rule import _deepest

    want = {(WsConfig(128, 2, 1, 1, 8), "gelu", ""): True, (WsConfig(256, 2, 2, 1, 5), None, ""): True,
            (_deepest(256, 2, 1, 1), "gelu_tanh", ""): True, (_deepest(256, 2, 1, 1), "gelu", ""): False,
            (_deepest(192, 2, 1, 1), "gelu", ""): False,
            (WsConfig(64, 3, stages=7, pp=True), None, ""): True, (WsConfig(64, 1, 1, 4, 8), "gelu", ""): False,
            (WsConfig(64, 2, 1, 1, 8), "gated_silu_first", ""): False,
            (WsConfig(128, 2, 1, 1, 8), "gelu", "#define KP_Y16 0\n"): False}
    for (cfg, act, head), staged16 in want.items():
        sass = _sass(compile_for(head + source(cfg, "bf16", True, act), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump next to Triton")
        assert ("STSM" in sass) == staged16, (cfg, act, head)
        assert "STL" not in sass, (cfg, act, head)


def _sass(cubin: bytes) -> str | None:
    """``cuobjdump -sass`` of a cubin, with the cuobjdump Triton ships; None where there is none."""
    import os
    import subprocess
    import tempfile

    triton = pytest.importorskip("triton")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def test_only_multicast_syncs_the_cluster_before_the_k_loop(compile_for):
    """A tile that multicasts x (CM > 1) syncs the cluster before its first copy, since the copies land in its
    peers' stages, again once its partial sums are in and once before it leaves.  One that only splits K syncs its own
    CTA there and splits the cluster's one sync: its arrival at the start, its wait before the partial sums are pushed
    (and the producers' before they leave); where the pushed sums would not fit beside the ring it syncs the cluster
    after the K loops and before leaving.  One without a cluster never syncs one (docs/design/0049, 0050).  Counted in
    the SASS: cluster barrier arrivals and waits (UCGABAR_ARV, UCGABAR_WAIT)."""
    from kernelplan.kernels.sparse24_ws import source

    want = {WsConfig(128, 2, 2, 1, 5): (3, 3), WsConfig(128, 2, 2, 2, 8): (3, 3), WsConfig(16, 2, 1, 2, 8): (1, 2),
            WsConfig(64, 1, 1, 4, 8): (1, 2), WsConfig(128, 2, 1, 2, 8): (2, 2), WsConfig(64, 2, 1, 1, 8): (0, 0)}
    for cfg, (arrivals, waits) in want.items():
        sass = _sass(compile_for(source(cfg, "bf16", False, None), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump next to Triton")
        assert (sass.count("UCGABAR_ARV"), sass.count("UCGABAR_WAIT")) == (arrivals, waits), cfg
        assert ("STAS" in sass) == (cfg.kc > 1 and cfg.cm == 1 and cfg.recv_bytes > 0), cfg


def test_no_variant_has_its_mmas_serialized(compile_for):
    """ptxas serializes a loop's wgmmas (warning C7515) where it cannot prove their registers are left alone while
    they run: each HGMMA then waits for itself (`DEPBAR.LE gsb0, 0x0`), and a step's MMAs stop overlapping. One form of
    the descriptors did that to every tile of 16 or 32 rows of x (13% slower at 1024x1024, docs/design/0029); this
    checks the step's MMAs commit as one group in each kind of tile."""
    from kernelplan.kernels.sparse24_ws import source
    from kernelplan.kernels.sparse24_ws_rule import _deepest

    cfgs = [_deepest(16, 1, 1, 1, pp=True), WsConfig(32, 1, 1, 2, 8), WsConfig(16, 2, 2, 1, 8),
            _deepest(48, 1, 1, 1, pp=True), _deepest(64, 3, 1, 1, pp=True), WsConfig(128, 2, 2, 2, 8),
            _deepest(256, 2, 1, 1)]
    for cfg in cfgs:
        sass = _sass(compile_for(source(cfg, "bf16", True, "gelu"), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump beside Triton")
        mmas = [line for line in sass.splitlines() if "HGMMA" in line]
        assert mmas and sass.count("DEPBAR.LE gsb0, 0x0") <= 2, cfg
        assert sum("gsb0" in line for line in mmas) < len(mmas), cfg  # a step's MMAs are one group


def _mma_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop (a backward branch and its target) around an HGMMA."""
    import re

    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    mmas = [at for at, text in code if "HGMMA" in text]
    loops = []
    for at, text in code:
        branch = re.search(r"BRA (?:\S+, )?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < at and any(int(branch.group(1), 16) <= m <= at for m in mmas):
            loops.append((int(branch.group(1), 16), at))
    start, end = min(loops, key=lambda loop: loop[1] - loop[0])
    return [text for at, text in code if start <= at <= end]


def test_the_k_loop_builds_its_descriptors_in_uniform_registers(compile_for):
    """HGMMA reads its descriptors from uniform registers.  Built from the warp index as threadIdx.x >> 5, they were
    computed per thread and moved over (R2UR) each step: 32 of a 64x128 ping-pong tile's 139 loop instructions.  With
    the index broadcast from lane 0 (hopper.cuh, warp_uniform) the loop has none (docs/design/0030).  Tiles of one
    16- or 32-row N block keep descriptors made from the address (sparse24_ring.cuh), and are not checked here."""
    from kernelplan.kernels.sparse24_ws import source
    from kernelplan.kernels.sparse24_ws_rule import _deepest

    for cfg in [_deepest(48, 1, 1, 1, pp=True), _deepest(64, 2, 1, 1, pp=True), _deepest(128, 1, 1, 1, pp=True),
                WsConfig(64, 1, 1, 1, 8), WsConfig(96, 2, 1, 2, 8), WsConfig(128, 2, 2, 2, 8), _deepest(256, 2, 1, 1)]:
        sass = _sass(compile_for(source(cfg, "bf16", True, "gelu"), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump beside Triton")
        loop = _mma_loop(sass)
        assert sum("HGMMA" in text for text in loop) >= 4, cfg
        assert not [text for text in loop if text.startswith("R2UR")], cfg


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


@pytest.mark.parametrize("n, m, k", [(200, 1000, 2048), (77, 528, 1024), (300, 272, 4096), (256, 4096, 1024),
                                     (90, 400, 1600)])
def test_candidate_space_of_the_gpu_test_shapes(n, m, k):
    """The shapes test_sparse24_wg.py's every-candidate GPU test runs reach every kind of tile, clusters of both."""
    cands = ws_candidates(n, m, k)
    assert {c.kc for c in cands} >= {1, 2, 4} and {c.cm for c in cands} == {1, 2, 4}
    assert {c.wm for c in cands} == {1, 2, 3}
    assert any(c.cm > 1 and c.kc > 1 for c in cands)


def test_the_gpu_test_shapes_split_k_unevenly_at_small_n_too():
    """K of 25 steps (test_sparse24_wg.py's 400 x 1600 cases): slices of 12 and 13, 6 and 7 steps, in the one-a-tile
    tiles and, at n = 8, the wide weight's split tile (and 8, 8 and 9 in the split over 3, docs/design/0063)."""
    assert wide_weight(400, 1600) and ws_config(8, 400, 1600, 132).kc == 4
    assert {c.kc for c in ws_candidates(8, 400, 1600)} == {1, 2, 3, 4}


def _units(plan, tiles: int, steps: int, c: int) -> list[tuple[int, int, int, int]]:
    """CTA c's work as cuda/sparse24_sk.cu's Schedule walks it: (unit, tile, part, first step, end step)."""
    out, v = [], c
    while True:
        if v < plan.dp_tiles:
            out.append((v, v, 0, 0, steps))
        elif v - plan.dp_tiles < plan.rest * plan.splits:
            part, r = divmod(v - plan.dp_tiles, plan.rest)
            out.append((v, plan.dp_tiles + r, part, steps * part // plan.splits, steps * (part + 1) // plan.splits))
        else:
            return out
        v += plan.grid


@pytest.mark.parametrize("sms", [78, 132])
def test_split_schedule_covers_every_step_once_and_heads_come_last(sms):
    """The kernel's schedule, emulated: each (tile, step) once; whole waves first; each split tile's head (its
    last part) has the highest unit number of its parts, so every part it waits on runs before it or beside it;
    the split fills the SMs at least as well as whole tiles would."""
    from kernelplan.kernels.sparse24_ws_rule import sk_plan

    for (m, k) in list(sweep_shapes()) + [(200, 128), (64, 64), (4096, 64 * 7)]:
        for n in (17, 200, 1000, 4096):
            for bn, wm in ((64, 1), (128, 2), (256, 2)):
                cfg = WsConfig(bn, wm, stages=4, sk=True)
                plan = sk_plan(cfg, n, m, k, sms)
                steps, tiles = k // 64, -(-n // bn) * -(-m // (64 * wm))
                assert 1 <= plan.grid <= sms and plan.tiles_n == -(-n // bn)
                assert plan.dp_tiles % sms == 0 and plan.dp_tiles + plan.rest == tiles and plan.rest < sms
                assert plan.splits == 1 or steps // plan.splits >= 4
                units = [u for c in range(plan.grid) for u in _units(plan, tiles, steps, c)]
                assert sorted(u[0] for u in units) == list(range(plan.dp_tiles + plan.rest * plan.splits))
                pieces = {}
                for v, t, part, k0, k1 in units:
                    assert k0 < k1
                    pieces.setdefault(t, []).append((k0, k1, part, v))
                assert sorted(pieces) == list(range(tiles)), (m, k, n, cfg, plan)
                for t, spans in pieces.items():  # each tile's parts cover its steps end to end, once
                    spans.sort()
                    assert spans[0][0] == 0 and spans[-1][1] == steps and all(
                        a[1] == b[0] for a, b in zip(spans, spans[1:])), (t, spans)
                    assert max(spans, key=lambda s: s[3])[2] == len(spans) - 1  # the head: highest unit
                if plan.rest:
                    fill = lambda s: plan.rest * s / (sms * -(-plan.rest * s // sms))
                    assert fill(plan.splits) >= fill(1) - 1e-9


def test_split_workspace_is_the_flags_and_each_handed_over_part():
    from kernelplan.kernels.sparse24_ws_rule import sk_plan

    cfg = WsConfig(128, 2, stages=8, sk=True)
    plan = sk_plan(cfg, 256, 5120, 13824, 132)  # 80 tiles on 132 SMs: split along K
    assert plan.dp_tiles == 0 and plan.rest == 80 and plan.splits > 1 and plan.grid == min(132, 80 * plan.splits)
    assert plan.workspace_bytes == -(-4 * plan.slots // 1024) * 1024 + plan.slots * 128 * 128 * 4
    assert sk_plan(cfg, 256, 8448, 4096, 132).splits == 1  # 132 tiles: one whole wave, no workspace
    assert sk_plan(cfg, 256, 8448, 4096, 132).workspace_bytes == 0
    wide = sk_plan(cfg, 4096, 5120, 13824, 132)  # 1280 tiles: 9 whole waves, then 92 tiles split
    assert wide.dp_tiles == 9 * 132 and wide.rest == 92 and wide.grid == 132
    assert cfg.shared == 8 * cfg.stage_bytes + 16 * 8 + 1024  # no partial sums in shared memory


@pytest.mark.parametrize("sms", [78, 132])
def test_ping_pong_schedule_gives_each_tile_once_in_the_producers_order(sms):
    """cuda/sparse24_pp.cu's loops, emulated: the producer fills CTA-local tile j's steps at j K/64 ...; warpgroup c
    takes j = c, c + 2, ... and reads those steps; every tile is taken once; the order barriers' waits are for the
    other warpgroup's (j - 1)-th K loop."""
    for tiles in (1, 5, sms - 1, sms, sms + 1, 3 * sms + 7):
        grid = min(sms, tiles)
        seen = []
        for cta in range(grid):
            produced = list(range(cta, tiles, grid))  # the producer's tiles, j = 0, 1, ...
            for c in (0, 1):
                j = c
                for t in range(cta + c * grid, tiles, 2 * grid):
                    assert produced[j] == t
                    if j > 0:  # waits on the phase completed by the other warpgroup's arrival after tile j - 1
                        assert ((j - 1) >> 1) == (j - 1 - (1 - c)) // 2
                    seen.append(t)
                    j += 2
        assert sorted(seen) == list(range(tiles))


@pytest.mark.parametrize("ni, wm", [(16, 1), (64, 2), (256, 1)])
def test_the_16_bit_staging_puts_every_accumulator_in_its_place(ni, wm):
    """sparse24_epilogue.cuh's stage_block16 addresses (the ping-pong kernel's blocks b of one warpgroup, and the
    K-whole tiles' one block of each warpgroup b), emulated with PTX's stmatrix .trans (lane 8q + i addresses column i
    of matrix q; register q holds row lane / 4, columns 2 (lane % 4) + 0, 1): the staging buffer's row n holds y's
    columns m = W's rows, each accumulator (wgmma's m64nN layout) once; and the `hi` the kernel's value() is given
    (p & 1) is the accumulator's row + 8, whose bias it adds."""
    bn = ni * 2
    stride = (64 * wm * 2 + 16) // 2  # in elements
    staging = {}
    for b in range(wm):
        for wq in range(4):
            for i in range(bn // ni):
                for j in range(0, ni // 8, 2):
                    regs = {}  # (lane, q) -> the two (row, column) pairs it holds, as the kernel packs them
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        for p in range(4):
                            at = 4 * (j + (p >> 1)) + 2 * (p & 1)
                            pair = []
                            for r in (at, at + 1):  # wgmma accumulator r of lane: its row and column
                                assert (r >> 1) & 1 == p & 1
                                row = 64 * b + 16 * wq + g + 8 * ((r >> 1) & 1)
                                col = i * ni + 8 * (r >> 2) + 2 * t + (r & 1)
                                pair.append((row, col))
                            regs[lane, p] = pair
                    for lane in range(32):  # the address lane `lane` gives: column i8 of matrix q
                        q, i8 = lane >> 3, lane & 7
                        nl = i * ni + 8 * (j + (q >> 1)) + i8
                        ml = 64 * b + 16 * wq + 8 * (q & 1)
                        for e in range(8):  # element e of that column: row e of matrix q, held by lane 4e + i8 // 2
                            row, col = regs[4 * e + i8 // 2, q][i8 % 2]
                            addr = nl * stride + ml + e
                            assert addr not in staging
                            staging[addr] = (row, col)
    assert len(staging) == bn * 64 * wm
    for addr, (row, col) in staging.items():
        assert addr == col * stride + row


def _Maps():
    """A TensorMaps whose two lookups are stubbed, each map 128 bytes naming what it maps (``encoded`` lists x's
    lookups), with the class's own table of x's maps by address."""
    from kernelplan.kernels.sparse24_ws import TensorMaps

    class Maps(TensorMaps):
        def __init__(self):
            self._x, self._x_params, self.encoded = {}, {}, []

        def x(self, x, n, k, stride):
            self.encoded.append((x, n, k, stride))
            return f"x {x:#x} {n} {k} {stride}".encode().ljust(128, b".")

        def w(self, values, codes, m, k):
            return f"v {values:#x} {m} {k}".encode().ljust(128, b"."), f"e {codes:#x} {m} {k}".encode().ljust(128, b".")

    return Maps()


@pytest.mark.parametrize("cfg", [WsConfig(bn=128, wm=2, cm=2, kc=2, stages=8), WsConfig(bn=64, wm=3, stages=7, pp=True)],
                         ids=["cluster", "ping-pong"])
def test_a_bound_launch_packs_what_the_launch_does(monkeypatch, cfg):
    """The eager fast path (``BoundLaunch``) writes the parameters and grid the full launch would, for each x."""
    from helpers import stub_driver
    from kernelplan.kernels import sparse24_ws

    monkeypatch.setattr(sparse24_ws, "sm_count", lambda device: 132)
    types = sparse24_ws._PP_PARAMS if cfg.pp else sparse24_ws._PARAMS
    stub = stub_driver(monkeypatch, types)
    launch = (sparse24_ws.PingPongLaunch if cfg.pp else sparse24_ws.MapLaunch)("fn", "kp", cfg, _Maps(), 0)
    n, m, k = 1000, 4608, 3584
    grid = (-(-n // cfg.bn), -(-m // cfg.rows), cfg.kc)  # the launch's own for one a tile; ping-pong takes its own
    args = lambda x, bias, y: (x, 0xA000, 0xB000, bias, y, n, m, k, k, m)  # noqa: E731
    bound = launch.bind(grid, args(0x1000, 0x2000, 0x3000))
    for x, bias, y in ((0x1000, 0x2000, 0x3000), (0x5000, 0, 0x6000), (0x1000, 0x2200, 0x3300)):
        launch(grid, args(x, bias, y), 3)
        bound(x, bias, y, 3)
        unbound, got = stub.launches[-2:]
        assert got == unbound
        assert got[4][0].startswith(f"x {x:#x} {n} {k} {k}".encode()) and got[4][1].startswith(b"v 0xa000")
    assert stub.launches[-1][0] == ((132, 1, 1) if cfg.pp else grid)


def test_bound_launches_of_one_shape_of_x_share_its_maps_and_each_thread_packs_its_own(monkeypatch):
    """Bound launches on two weights with x of one shape read x's map from one table (``TensorMaps.x_params``): the
    map of an address is encoded once for both; another shape of x has its own table; a full table is emptied.  A
    thread other than the binding one packs into buffers of its own, and launches the same parameters."""
    import threading

    from helpers import stub_driver
    from kernelplan.kernels import sparse24_ws

    monkeypatch.setattr(sparse24_ws, "sm_count", lambda device: 132)
    stub = stub_driver(monkeypatch, sparse24_ws._PARAMS)
    cfg, maps = WsConfig(bn=128, wm=2, stages=6), _Maps()
    launch = sparse24_ws.MapLaunch("fn", "kp", cfg, maps, 0)
    args = lambda x, values, n: (x, values, 0xB000, 0, 0x3000, n, 4096, 1024, 1024, 4096)  # noqa: E731
    first, second = (launch.bind((1, 32, 1), args(0x1000, values, 256)) for values in (0xA000, 0xC000))
    maps.encoded.clear()  # binding packs x's map too (the real TensorMaps keeps it: the stub counts lookups)
    for bound in (first, second, first):
        bound(0x1000, 0, 0x3000, 3)
        bound(0x2000, 0, 0x3000, 3)
    assert maps.encoded == [(0x1000, 256, 1024, 1024), (0x2000, 256, 1024, 1024)]
    assert first._maps is second._maps
    other = launch.bind((1, 32, 1), args(0x1000, 0xA000, 128))
    maps.encoded.clear()
    other(0x1000, 0, 0x3000, 3)
    assert other._maps is not first._maps and maps.encoded == [(0x1000, 128, 1024, 1024)]
    for x in range(0x10000, 0x10000 + 16 * (maps.MAX_X_PARAMS + 1), 16):
        first(x, 0, 0x3000, 3)
    assert len(first._maps) <= maps.MAX_X_PARAMS
    here = stub.launches[-1]
    thread = threading.Thread(target=first, args=(x, 0, 0x3000, 3))
    thread.start()
    thread.join()
    assert stub.launches[-1] == here and first._buffers[2] != stub.addresses[-1]


def test_a_split_tail_launch_is_not_bound(monkeypatch):
    from helpers import stub_driver
    from kernelplan.kernels import sparse24_ws

    monkeypatch.setattr(sparse24_ws, "sm_count", lambda device: 132)
    stub_driver(monkeypatch, sparse24_ws._SK_PARAMS)
    cfg = WsConfig(bn=128, wm=2, stages=6, sk=True)
    assert sparse24_ws.StreamKLaunch("fn", "kp", cfg, _Maps(), 0).bind((1, 1, 1), (0,) * 10) is None


@pytest.mark.parametrize("bn, wm, kc", [(16, 1, 2), (16, 2, 2), (32, 1, 4), (64, 3, 2)])
def test_pushed_sums_index_arithmetic_meets_every_slice_once(bn, wm, kc):
    """The pushed sums' index arithmetic (sparse24_ws.cu), emulated over a cluster of K slices: each slice pushes the
    other slices' rows of its partial sums to their CTAs' slots, past the ring and its barriers (recv_bytes: the
    slots and the sums barrier), and each CTA's rows, read back in rank order from its own sums and its slots, are
    the sum over every slice, each slice's part exactly once."""
    rows_here, bm = bn // kc, 64 * wm
    stride = bm + 4
    red_floats = bn * stride
    cfg = WsConfig(bn, wm, 1, kc, 8)
    recv = max(8 * cfg.stage_bytes, red_floats * 4) // 4 + (16 * 8 + 16) // 4  # kRecvAt, in floats
    assert cfg.recv_bytes == (kc - 1) * rows_here * stride * 4 + 16
    chunks = rows_here * bm // 4
    gen = torch.Generator().manual_seed(bn * kc + wm)
    red = [torch.randn(bn, stride, generator=gen, dtype=torch.float64) for _ in range(kc)]
    smem = [torch.full((recv + (kc - 1) * rows_here * stride,), float("nan"), dtype=torch.float64)
            for _ in range(kc)]
    for cz in range(kc):
        smem[cz][:red_floats] = red[cz].flatten()
    for cz in range(kc):  # the push loop, each idx once (the threads' stride does not change the set)
        for idx in range((kc - 1) * chunks):
            q, nl, c = idx // chunks, idx % chunks // (bm // 4), idx % (bm // 4)
            p, slot = q + (q >= cz), cz - (cz > q + (q >= cz))
            src = ((p * rows_here + nl) * stride + 4 * c)
            dst = recv + ((slot * rows_here + nl) * stride + 4 * c)
            assert torch.isnan(smem[p][dst:dst + 4]).all(), "a slot written twice"
            smem[p][dst:dst + 4] = smem[cz][src:src + 4]
    for cz in range(kc):  # the epilogue's reads: slice r's sums of this CTA's rows, in rank order
        nl0 = cz * rows_here
        for nl in range(nl0, nl0 + rows_here):
            at = nl * stride
            got = torch.zeros(bm, dtype=torch.float64)
            for r in range(kc):
                slot = r - (r > cz)
                frm = at if r == cz else at + recv + (slot * rows_here - nl0) * stride
                got += smem[cz][frm:frm + bm]
            want = sum(red[r][nl, :bm] for r in range(kc))
            assert torch.equal(got, want), (cz, nl)


def _generic_loads(sass: str) -> list[str]:
    """The SASS's generic loads (LD, not LDS/LDG): how another CTA's shared memory is read (ld.shared::cluster)."""
    return [line for line in sass.splitlines() if re.search(r"\*/\s+(@!?U?P\w+\s+)?LD(\.|\s)", line)]


def test_pushed_sums_leave_no_loads_from_a_peer(compile_for):
    """K-split tiles without multicast, plain and gated, push their partial sums as st.async (STAS) and load nothing
    from another CTA's shared memory; the KP_PUSH_SUMS=0 build (the A/B's, docs/design/0050) loads the peers' sums
    and syncs the cluster twice after its K loops."""
    from kernelplan.kernels.sparse24_ws import source

    for cfg, act in ((WsConfig(16, 2, 1, 2, 8), None), (WsConfig(32, 1, 1, 4, 8), "gelu"),
                     (WsConfig(64, 2, 1, 2, 8), "gated_silu_second")):
        sass = _sass(compile_for(source(cfg, "bf16", True, act), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump next to Triton")
        assert "STAS" in sass and not _generic_loads(sass) and sass.count("UCGABAR_ARV") == 1, cfg
        apart = _sass(compile_for("#define KP_PUSH_SUMS 0\n" + source(cfg, "bf16", True, act), "sm_90a"))
        assert "STAS" not in apart and _generic_loads(apart) and apart.count("UCGABAR_ARV") == 2, cfg


def test_the_pdl_build_waits_for_the_kernel_before_and_lets_the_next_start(compile_for):
    """KP_PDL=1 (an experiment, docs/design/0050) builds griddepcontrol.launch_dependents (SASS PREEXIT) and
    griddepcontrol.wait (ACQBULK) on the producer's and the consumers' paths, before x is read and y stored, with W's
    first copies ahead of the wait; KP_PDL=2 copies nothing before it.  The default build has neither.  The grouped
    kernel, which reads its routing first, refuses it."""
    from kernelplan.errors import KernelPlanError
    from kernelplan.kernels.sparse24_ws import source

    for cfg, act in ((WsConfig(16, 2, 1, 2, 8), None), (WsConfig(128, 2, 2, 1, 5), "gelu"),
                     (WsConfig(64, 2, 1, 2, 8), "gated_silu_second"), (WsConfig(64, 2, 1, 1, 8), None)):
        sass = _sass(compile_for("#define KP_PDL 1\n" + source(cfg, "bf16", True, act), "sm_90a"))
        if sass is None:
            pytest.skip("no cuobjdump next to Triton")
        assert sass.count("ACQBULK") == 2 and "PREEXIT" in sass, cfg
        assert "UTMALDG" in sass[: sass.find("ACQBULK")], cfg  # W's first fill goes out before the wait
        safe = _sass(compile_for("#define KP_PDL 2\n" + source(cfg, "bf16", True, act), "sm_90a"))
        assert safe.count("ACQBULK") == 2 and "UTMALDG" not in safe[: safe.find("ACQBULK")], cfg
        plain = _sass(compile_for(source(cfg, "bf16", True, act), "sm_90a"))
        assert "ACQBULK" not in plain and "PREEXIT" not in plain, cfg
    with pytest.raises(KernelPlanError, match="KP_PDL"):
        compile_for("#define KP_PDL 1\n" + source(WsConfig(64, 2), "bf16", False, None, grouped=True), "sm_90a")


@gpu
@sm90
@pytest.mark.parametrize("n", [1, 9, 16])
def test_deeper_rings_match_fp64(n, seed):
    """with_ring's 12 and 16 stages (docs/design/0066), launched as they are, on every kind of tile one CTA an SM: K
    over 2 with the pushed sums, over 4, over 3, K whole and ping-pong of one and two blocks; K of 33 steps (slices of
    16 and 17; 8 and 9; 11) and of 25 (a ring deeper than a slice: the producer stops at the slice's end), M off the
    blocks, bias and GELU, against fp64.  y starts as NaN."""
    from kernelplan.kernels.sparse24_ws_rule import _deepest

    forms = [(16, 2, 1, 2, False), (32, 2, 1, 4, False), (24, 2, 1, 3, False), (16, 2, 1, 1, False),
             (16, 2, 1, 1, True), (16, 1, 1, 1, True)]
    for k in (2112, 1600):
        cfgs = []
        for bn, wm, cm, kc, pp in forms:
            base = _deepest(bn, wm, cm, kc, pp=pp)
            cfgs += [replace(base, stages=s) for s in (12, 16) if replace(base, stages=s).shared <= SM_SHARED]
        assert {c.stages for c in cfgs} == {12, 16} and len(cfgs) >= 10
        _launch_against_fp64(cfgs, n, 1000, k)


@gpu
@sm90
def test_a_layer_runs_the_rules_deeper_ring(seed):
    """Through Sparse24Linear: 5120 x 3072 at n <= 16 picks 80 CTAs of 16 x 128 over 2 with a ring of 12 (0066); its
    launches are that tile's, against fp64, 3-D x and graph replay included."""
    from kernelplan.kernels.sparse24_ws_rule import ws_config
    from test_sparse24_tiles import _tile_of_last_launch

    m, k = 5120, 3072
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, device="cuda", dtype=torch.bfloat16))
    w, b = layer.to_dense().double(), layer.bias.detach().double()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with torch.no_grad():
        for x in (torch.randn(8, k, device="cuda", dtype=torch.bfloat16),
                  torch.randn(2, 3, k, device="cuda", dtype=torch.bfloat16)):
            assert_close(layer(x), F.linear(x.double(), w, b), F.linear(x, w.bfloat16(), b.bfloat16()),
                         atol=FWD_ATOL[torch.bfloat16], what=f"x of {tuple(x.shape)}")
        picks = {str(layer_pick) for layer_pick in (WsKernel().config(8, m, k, 0), WsKernel().config(6, m, k, 0))}
        assert all(ws_config(n, m, k, sms).stages == 12 for n in (6, 8))
        assert _tile_of_last_launch(layer, by_shape=True) == picks
        xg, yg = _graph_replayed(layer, 5, torch.bfloat16)
    assert_close(yg, F.linear(xg.double(), w, b), F.linear(xg, w.bfloat16(), b.bfloat16()),
                 atol=FWD_ATOL[torch.bfloat16], what="graph replay")


@gpu
@sm90
@pytest.mark.parametrize("n, dtype", [(200, torch.bfloat16), (37, torch.bfloat16), (200, torch.float16)], ids=str)
def test_tiles_of_192_rows_splitting_k_match_fp64(n, dtype, seed):
    """wide_k_splits (docs/design/0067) launched as they are: 192 rows of W, x's tile of 64 and 128 rows, K over 2
    (the pushed sums where their buffer fits beside the ring, else met through the cluster's loads) and over 4, x
    multicast to 2 or not; K of 25 steps (slices of 12 and 13; 6, 6, 6 and 7), M off the blocks, bias and GELU, bf16
    and f16, against fp64.  y starts as NaN."""
    from kernelplan.kernels.sparse24_ws_rule import _deepest, wide_k_splits

    k = 1600
    cfgs = wide_k_splits([_deepest(bn, 3, cm, 1) for bn in (64, 128) for cm in (1, 2)], k)
    assert {c.kc for c in cfgs} == {2, 4} and {c.cm for c in cfgs} == {1, 2} and len(cfgs) == 8
    assert {c.recv_bytes > 0 for c in cfgs} == {True, False}
    _launch_against_fp64(cfgs, n, 1000, k, dtype)


@gpu
@sm90
def test_a_layer_runs_a_tile_of_192_rows_splitting_k(seed):
    """Through Sparse24Linear: 5120 x 13824 at n = 256 runs the rule's tile, on 132 SMs 192 x 128 with K over a
    cluster of 2 (docs/design/0067); against fp64, 3-D x and graph replay included."""
    from kernelplan.kernels.sparse24_ws_rule import wide_split
    from test_sparse24_tiles import _tile_of_last_launch

    m, k = 5120, 13824
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, device="cuda", dtype=torch.bfloat16))
    w, b = layer.to_dense().double(), layer.bias.detach().double()
    with torch.no_grad():
        x = torch.randn(2, 128, k, device="cuda", dtype=torch.bfloat16)
        assert_close(layer(x), F.linear(x.double(), w, b), F.linear(x, w.bfloat16(), b.bfloat16()),
                     atol=FWD_ATOL[torch.bfloat16], what="x of 2 x 128 rows")
        pick = WsKernel().config(256, m, k, 0)
        assert _tile_of_last_launch(layer, by_shape=True) == {str(pick)}
        assert wide_split(pick) or torch.cuda.get_device_properties(0).multi_processor_count != 132
        xg, yg = _graph_replayed(layer, 256, torch.bfloat16)
    assert_close(yg, F.linear(xg.double(), w, b), F.linear(xg, w.bfloat16(), b.bfloat16()),
                 atol=FWD_ATOL[torch.bfloat16], what="graph replay")


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_layer_runs_the_twin_of_one_block_and_one_tile_of_x(seed, dtype):
    """Through Sparse24Linear: 4096 x 4096 at n = 128 runs the rule's tile, on 132 SMs 128 rows of x and one block of
    W with K over a cluster of 2 (docs/design/0068); against fp64, 3-D x (2 x 60 rows: n = 120) and graph replay."""
    from test_sparse24_tiles import _tile_of_last_launch

    m, k = 4096, 4096
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, device="cuda", dtype=dtype))
    w, b = layer.to_dense().double(), layer.bias.detach().double()
    with torch.no_grad():
        x = torch.randn(2, 60, k, device="cuda", dtype=dtype)
        assert_close(layer(x), F.linear(x.double(), w, b), F.linear(x, w.to(dtype), b.to(dtype)),
                     atol=FWD_ATOL[dtype], what="x of 2 x 60 rows")
        pick = WsKernel().config(120, m, k, 0)
        assert _tile_of_last_launch(layer, by_shape=True) == {str(pick)}
        on_132 = torch.cuda.get_device_properties(0).multi_processor_count == 132
        assert (pick.bn, pick.wm, pick.kc) == (128, 1, 2) or not on_132
        xg, yg = _graph_replayed(layer, 128, dtype)
    assert_close(yg, F.linear(xg.double(), w, b), F.linear(xg, w.to(dtype), b.to(dtype)),
                 atol=FWD_ATOL[dtype], what="graph replay")
