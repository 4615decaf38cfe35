"""Opt-in tile tuning of ``cuda_ws`` (``sparse24/tiles.py``): its candidates, its decision and its stored choices on
CPU; on a Hopper GPU, the tuned tile's results against fp64, its reach to layers called before, and graph replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, sm90
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.errors import InvalidProblem
from kernelplan.sparse24 import tiles
from kernelplan.kernels.sparse24_sp import SM_SHARED, SpConfig, SpKernel, sp_candidates, sp_config
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import WsConfig, gated_tile, ws_candidates, ws_config
from kernelplan.sparse24.dispatch import backend_for, config_for

gpu = pytest.mark.gpu
SMS = 132


@pytest.fixture(autouse=True)
def _untuned():
    tiles.clear_tuned_tiles()
    yield
    tiles.clear_tuned_tiles()


@pytest.mark.parametrize("gated", [False, True])
def test_candidates_start_with_the_rules_pick_and_stay_in_its_space(gated):
    for m, k in list(sweep_shapes())[::3]:
        for n in (17, 64, 128, 200, 512, 2048):
            cands = tiles.candidates(n, m, k, SMS, gated, top=5)
            assert cands[0] == ws_config(n, m, k, SMS, gated)
            assert len(cands) == len(set(cands)) <= 5
            assert set(cands) <= set(ws_candidates(n, m, k))
            assert not gated or all(gated_tile(c) for c in cands)


def test_sp_candidates_start_with_the_rules_pick_and_are_tiles_the_kernel_runs():
    for m, k in sweep_shapes():
        for n in (1, 8, 9, 16, 33, 64):
            cands = sp_candidates(n, m, k, SMS)
            assert cands[0] == sp_config(n, m, k, SMS) and len(cands) == len(set(cands)) >= 4
            assert tiles.candidates(n, m, k, SMS, True, 3, "cuda_sp") == cands[:3]  # gated or not: all gated-capable
            for c in cands:
                assert c.n_tiles * 8 >= n > c.n_tiles * 4 or (n <= 8 and c.n_tiles == 1)
                assert c.k_warps <= k // 64 and c.threads <= 512 and c.shared <= SM_SHARED - 1024
                assert c.m_warps * c.row_tiles % 2 == 0 and 2 <= c.stages <= 6  # a gated CTA splits its tiles


def test_the_run_of_n_is_the_rules_grain():
    from kernelplan.sparse24.dispatch import N_GRAIN, rule_points

    assert [tiles.run_of(n) for n in (1, 8, 9, 16, 17)] == [0, 0, 1, 1, 2]
    # rule_points gives one n of each run: distinct runs
    points = rule_points(100)
    assert len({tiles.run_of(n) for n in points}) == len(points) and N_GRAIN == 8


def _rounds(rule_ms, other_ms):
    a, b = WsConfig(64, 2), WsConfig(128, 2)
    return {a: rule_ms, b: other_ms}, a, b


def test_decide_keeps_the_rule_unless_another_tile_wins_by_min_gain():
    times, rule, other = _rounds([1.0] * 5, [0.98] * 5)  # 2% faster: under the default 3%
    assert tiles.decide(times, rule) == (rule, 1.0)
    assert tiles.decide(times, rule, min_gain=0.01) == (other, pytest.approx(1 / 0.98))
    times, rule, other = _rounds([1.0] * 5, [0.9] * 5)
    assert tiles.decide(times, rule) == (other, pytest.approx(1 / 0.9))
    assert tiles.decide({rule: [1.0]}, rule) == (rule, 1.0)  # nothing else timed


def test_decide_needs_the_gain_in_most_rounds_whatever_the_gpus_pace():
    # The GPU slows 2x for the last three rounds: the other tile is 5% faster in every round.
    slow = [1.0, 1.0, 2.0, 2.0, 2.0]
    times, rule, other = _rounds(slow, [0.95 * t for t in slow])
    assert tiles.decide(times, rule)[0] == other
    # A tile that is faster in two rounds of five is not kept, however large its lead there.
    times, rule, other = _rounds([1.0] * 5, [0.5, 0.5, 1.01, 1.01, 1.01])
    assert tiles.decide(times, rule) == (rule, 1.0)


def test_decide_takes_the_larger_median_gain():
    a, b, c = WsConfig(64, 2), WsConfig(128, 2), WsConfig(64, 1, pp=True)
    assert tiles.decide({a: [1.0] * 3, b: [0.9] * 3, c: [0.8] * 3}, a)[0] == c


def test_a_stored_choice_holds_only_under_todays_rule_and_candidates():
    rule, tile = WsConfig(64, 1, pp=True, stages=8), WsConfig(64, 2, kc=2, stages=8)
    value = {"rule": dataclasses.asdict(rule), "tile": dataclasses.asdict(tile)}
    assert tiles._stored(value, rule, [rule, tile]) == tile
    assert tiles._stored(value, tile, [rule, tile]) is None  # chosen under another rule pick: measured again
    assert tiles._stored(value, rule, [rule]) is None  # no longer a candidate
    assert tiles._stored({"rule": {"bn": "x", "nope": 1}, "tile": {}}, rule, [rule]) is None  # does not parse
    assert tiles._stored({"tile": dataclasses.asdict(tile)}, rule, [rule, tile]) is None


def test_the_kernel_takes_a_tuned_tile_for_the_run_of_n_and_the_rule_elsewhere(monkeypatch):
    from kernelplan.kernels import sparse24_sp, sparse24_wg, sparse24_ws
    from kernelplan.kernels.gpu_facts import GpuFacts

    monkeypatch.setattr(sparse24_wg, "sm_count", lambda device: SMS)
    monkeypatch.setattr(sparse24_ws, "sm_count", lambda device: SMS)
    monkeypatch.setattr(sparse24_ws, "device_facts", lambda device: GpuFacts.model(SMS))
    monkeypatch.setattr(sparse24_sp, "sm_count", lambda device: SMS)
    monkeypatch.setattr(sparse24_sp, "shared_per_block", lambda device: 227 * 1024)  # Hopper's
    sp_other = sp_candidates(8, 28672, 4096, SMS)[3]
    tiles._TUNED[(0, "cuda_sp", 28672, 4096, tiles.run_of(8), False)] = sp_other
    assert SpKernel().config(1, 28672, 4096, 0) == sp_other and SpKernel().config(9, 28672, 4096, 0) != sp_other
    assert WsKernel().config(8, 28672, 4096, 0) == ws_config(8, 28672, 4096, SMS)  # a backend's choice is its own
    m, k = 3584, 3584
    other = tiles.candidates(128, m, k, SMS, False)[2]
    tiles._TUNED[(0, "cuda_ws", m, k, tiles.run_of(128), False)] = other
    kernel = WsKernel()
    assert kernel.config(128, m, k, 0) == kernel.config(121, m, k, 0) == other
    assert kernel.config(129, m, k, 0) == ws_config(129, m, k, SMS)  # the next run
    assert kernel.config(128, m, k, 1) == ws_config(128, m, k, SMS)  # another device
    assert kernel.config(128, m, k, 0, "gated_silu_first") == ws_config(128, m, k, SMS, True)  # gated is apart
    tiles.clear_tuned_tiles()
    assert kernel.config(128, m, k, 0) == ws_config(128, m, k, SMS)


def test_drop_launches_empties_every_live_weights_launch_tables():
    from kernelplan.kernels import sparse24_mma

    class Weight:  # the two tables of a _TiledWeight
        def __init__(self):
            self._calls, self._direct = {1: "launch"}, {2: "bound"}

    weights = [Weight(), Weight()]
    for w in weights:
        sparse24_mma._LIVE.add(w)
    sparse24_mma.drop_launches()
    assert all(w._calls == {} and w._direct == {} for w in weights)


@pytest.mark.parametrize("shapes, sizes, match", [
    ([(0, 64)], [32], "not positive"),
    ([(128, 64, "gelu", 1)], [32], r"give \(M, K\)"),
    ([(128, 64, "swish")], [32], "epilogue 'swish'"),
    ([(48, 64, "gated_silu_first")], [32], "M % 32"),
    ([(128, 64)], [0, 32], "positive numbers of rows"),
    ([(128, 64)], [], "positive numbers of rows"),
])
def test_bad_shapes_and_batch_sizes_are_refused_with_the_fix(shapes, sizes, match):
    with pytest.raises(InvalidProblem, match=match):
        tiles._check(shapes, sizes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error")
def test_tuning_without_cuda_says_it_times_cuda_kernels():
    with pytest.raises(InvalidProblem, match="no CUDA device"):
        kp.sparse24.tune_tiles([(128, 128)], [32])


def test_warmup_with_tune_on_cpu_tunes_nothing_and_says_so():
    model = torch.nn.Sequential(kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(128, 64)))
    rows = kp.warmup(model, (4,), progress=False, tune=True)
    assert rows and all("tile" not in r for r in rows) and tiles._TUNED == {}


def test_the_warmup_table_says_what_tuning_kept():
    from kernelplan.warm import table

    row = {"m": 2048, "k": 1024, "dtype": "torch.bfloat16", "bias": True, "n": 64, "backend": "cuda_ws",
           "config": "WsConfig(bn=64)", "expected": None}
    assert "[tuned" not in table([row])
    line = table([{**row, "tile": "1.073x over the rule's"}]).splitlines()[1]
    assert line.endswith("[tuned: 1.073x over the rule's]")


def test_the_warmup_note_says_what_was_kept_and_whether_it_was_stored():
    from kernelplan.warm import tile_note

    rule, other = WsConfig(64, 2), WsConfig(128, 2)
    assert tile_note(tiles.TileChoice(1, 1, 1, False, rule, rule, 1.0, 1.0, 1.0)) == "rule"
    assert tile_note(tiles.TileChoice(1, 1, 1, False, rule, other, gain=1.0734, source="stored")) == \
        "1.073x over the rule's (stored)"
    assert tile_note(tiles.TileChoice(1, 1, 1, False, rule, other, source="stored")) == "not the rule's (stored)"


def test_table_says_what_was_kept():
    rule, other = WsConfig(64, 2), WsConfig(128, 2)
    text = tiles.table([tiles.TileChoice(4096, 4096, 128, False, rule, other, 1.1, 1.0, 1.1),
                        tiles.TileChoice(4096, 4096, 256, False, rule, rule, 1.0, 1.0, 1.0),
                        tiles.TileChoice(9216, 4096, 8, False, None, None, source="not tuned", reason="cuda_sp")])
    lines = text.splitlines()
    assert "other" in lines[1] and "1.100" in lines[1] and f"(rule: {rule})" in lines[1]
    assert "rule" in lines[2] and "1.000" in lines[2] and lines[3].endswith("cuda_sp")


# -- on a Hopper GPU ----------------------------------------------------------------------------------------------


def _layer(m, k, dtype=torch.bfloat16):
    dense = torch.nn.Linear(k, m, device="cuda", dtype=dtype)
    return kp.nn.Sparse24Linear.from_dense(dense), dense


def _tile_of_last_launch(layer, by_shape: bool = False):
    """The tiles (str of a WsConfig or SpConfig) of the launches a layer's weight prepared (its _TiledWeight's
    tables), read from each launch's name: the kernel's name, the tile, the dtype.  ``by_shape``: those of every
    weight of the layer's shape (a weight held public has its tiled layout derived beside it, at another address)."""
    from kernelplan.kernels.sparse24_mma import _LIVE

    held = [w for w in list(_LIVE) if ((w.m, w.k) == (layer.out_features, layer.in_features) if by_shape
                                       else w.weight[0] == layer.values.data_ptr())]
    launches = [entry[0] for w in held for entry in w._calls.values()]
    launches += [getattr(b, "launch", None) for w in held for b, _ in w._direct.values()]
    return {" ".join(f.name.split(" ")[1:-1]) for f in launches if f is not None}


@gpu
@sm90
def test_tuning_times_measures_stores_and_reads_back(tmp_path, monkeypatch, seed):
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))
    shapes = [(3584, 3584), (1536, 768, "gated_silu_first"), (9216, 4608), (1024, 200)]
    got = kp.sparse24.tune_tiles(shapes, [8, 128, 200], rounds=3)
    assert len(got) == 12 and all(c.tile is not None for c in got)  # K = 200: its padded K's tiles (0083)
    untuned = kp.sparse24.tune_tiles([(1024, 256)], [8, 128], dtype=torch.float32)
    assert [(c.m, c.n, c.tile) for c in untuned] == [(1024, 8, None), (1024, 128, None)]
    assert all("triton" in c.reason and "f32" in c.reason for c in untuned)
    cap = torch.cuda.get_device_capability(0)
    for c in got:
        if c.tile is not None:
            backend = backend_for(cap, c.n, c.m, c.k, "bf16")
            assert tiles.backend_of(c.tile) == backend and (backend == "cuda_sp") == (c.m == 9216 and c.n == 8)
            assert c.source == "measured" and c.rule_ms > 0 and c.tile_ms > 0
            assert list(c.times_ms)[0] == str(c.rule) and c.times_ms[str(c.tile)] == c.tile_ms
            assert c.tile == c.rule or c.gain >= 1 + tiles.MIN_GAIN
            assert tiles.tuned_tile(0, c.n, c.m, c.k, c.gated, backend) == c.tile
    tiles.clear_tuned_tiles()

    def no_timing(*a, **kw):
        raise AssertionError("a stored choice was timed again")

    monkeypatch.setattr(tiles, "_measure", no_timing)
    again = kp.sparse24.tune_tiles(shapes, [8, 128, 200])
    assert [c.tile for c in again] == [c.tile for c in got]
    assert {c.source for c in again if c.tile is not None} == {"stored"}


@gpu
@sm90
@pytest.mark.parametrize("n, m, k", [(128, 3584, 3584), (125, 3584, 3584), (121, 3584, 3584), (3, 9216, 4608)])
def test_a_tuned_tile_reaches_a_layer_called_before_and_matches_fp64(n, m, k, seed):
    layer, dense = _layer(m, k)
    x = torch.randn(n, 2, k, device="cuda", dtype=torch.bfloat16).transpose(0, 1)  # 3-D, not contiguous: 2n rows
    want = F.linear(x.double(), layer.to_dense().double(), dense.bias.double())
    backend = backend_for(torch.cuda.get_device_capability(0), 2 * n, m, k, "bf16")
    assert backend == ("cuda_sp" if n == 3 else "cuda_ws")
    with torch.inference_mode():
        layer(x)
        rule = config_for(backend, 2 * n, m, k, torch.cuda.get_device_properties(0).multi_processor_count)
        assert _tile_of_last_launch(layer) == {str(rule)}
        other = next(c for c in tiles.candidates(2 * n, m, k, 132, False, backend=backend) if c != rule)
        tiles._TUNED[(0, backend, m, k, tiles.run_of(2 * n), False)] = other
        tiles._drop_launches()
        y = layer(x)
        assert _tile_of_last_launch(layer) == {str(other)}
    assert_close(y, want, F.linear(x, layer.to_dense(), dense.bias), atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
def test_a_tuned_tile_replays_in_a_cuda_graph(seed):
    m, k, n = 3072, 3072, 128
    layer, dense = _layer(m, k)
    rule = ws_config(n, m, k, 132)
    other = next(c for c in tiles.candidates(n, m, k, 132, False) if c != rule)
    tiles._TUNED[(0, "cuda_ws", m, k, tiles.run_of(n), False)] = other
    x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(x)  # warm-up: the launch is prepared outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _tile_of_last_launch(layer) == {str(other)}
    want = F.linear(x.double(), layer.to_dense().double(), dense.bias.double())
    assert_close(y, want, F.linear(x, layer.to_dense(), dense.bias), atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
def test_warmup_with_tune_tunes_the_models_gemms(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))
    model = torch.nn.Sequential(kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(1024, 2048, device="cuda",
                                                                                  dtype=torch.bfloat16)))
    rows = kp.warmup(model, (64,), progress=False, tune=True)
    assert [r["n"] for r in rows] == [64] and rows[0]["tile"].startswith(("rule", "1."))
    tile = tiles.tuned_tile(0, 64, 2048, 1024, False)
    assert tile is not None and rows[0]["config"] == str(tile)  # the row's kernel is the tuned one
    assert f"[tuned: {rows[0]['tile']}]" in kp.warm.table(rows)


def test_the_warmup_command_with_tune_on_cpu_tunes_nothing(tmp_path):
    from helpers import kernelplan_cli

    shapes = tmp_path / "shapes.json"
    shapes.write_text("[[64, 128]]")
    out = kernelplan_cli("warmup", "--shapes", shapes, "--batch-sizes", "32", "--device", "cpu", "--tune")
    assert out.returncode == 0, out.stderr
    assert "64 x 128" in out.stdout and "[tuned" not in out.stdout


@gpu
@sm90
def test_the_warmup_command_tunes_once_and_a_second_run_reads_the_stored_choice(tmp_path):
    from helpers import kernelplan_cli

    shapes = tmp_path / "shapes.json"
    shapes.write_text("[[3584, 3584]]")
    env = {"KERNELPLAN_CACHE_DIR": str(tmp_path / "cache")}
    first = kernelplan_cli("warmup", "--shapes", shapes, "--batch-sizes", "128", "--tune", env=env)
    assert first.returncode == 0, first.stderr
    assert "[tuned: rule]" in first.stdout or "over the rule's]" in first.stdout
    again = kernelplan_cli("warmup", "--shapes", shapes, "--batch-sizes", "128", "--tune", env=env)
    kept = "rule" if "[tuned: rule]" in first.stdout else first.stdout.split("[tuned: ")[1].split("]")[0]
    assert again.returncode == 0 and f"[tuned: {kept} (stored)]" in again.stdout, again.stdout + again.stderr


# -- tune_tiles' orchestration on CPU: a Hopper of 132 SMs faked, each candidate's timing scripted -------------------


@pytest.fixture
def fake_hopper(monkeypatch, tmp_path):
    """tune_tiles on a CPU machine: capability 9.0, 132 SMs, a plan cache in tmp_path, and ``_measure`` replaced by a
    script: ``timed`` lists each call's (n, m, k, candidates); the tile named by ``faster[(m, k, n)]`` reads 0.8 of
    the rule's time, every other one 1.0."""
    from kernelplan import cache, kernels
    from kernelplan.kernels import gpu_facts, sparse24_ws
    from kernelplan.kernels import sparse24 as kernels_sparse24

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(kernels_sparse24, "sm_count", lambda index: SMS)
    monkeypatch.setattr(sparse24_ws, "sm_count", lambda index: SMS)
    for module in (gpu_facts, sparse24_ws):  # the rule's clusters: the model's, not a driver's
        monkeypatch.setattr(module, "device_facts", lambda index: gpu_facts.GpuFacts.model(SMS))
    monkeypatch.setattr(kernels, "on_device", lambda index: __import__("contextlib").nullcontext())
    monkeypatch.setattr(kernels, "stream_capturing", lambda: False)
    monkeypatch.setattr(cache, "environment_fingerprint", lambda device="cpu": {"gpu": "fake H100", "device": device})
    monkeypatch.setattr(tiles, "compile_all", lambda variants, index: None)
    script = {"timed": [], "faster": {}}

    def measure(cands, n, m, k, dtype, activation, index, rounds):
        script["timed"].append((n, m, k, tuple(cands)))
        fast = script["faster"].get((m, k, n))
        return {c: [0.8 if c == fast else 1.0] * rounds for c in cands}

    monkeypatch.setattr(tiles, "_measure", measure)
    return script


def test_tune_tiles_returns_a_choice_per_shape_and_n_and_applies_it(fake_hopper):
    m, k = 3584, 3584
    other = tiles.candidates(128, m, k, SMS, False)[4]
    fake_hopper["faster"][(m, k, 128)] = other
    tall = 57344, 8192  # n <= 8 on it: the rule runs cuda_sp
    assert backend_for((9, 0), 8, *tall, "bf16") == "cuda_sp"
    sp_other = sp_candidates(8, *tall, SMS)[1]
    fake_hopper["faster"][(*tall, 8)] = sp_other
    got = kp.sparse24.tune_tiles([(m, k), tall, (1024, 200)], [128, 8])
    assert [(c.m, c.n) for c in got] == [(m, 8), (m, 128), (tall[0], 8), (tall[0], 128), (1024, 8), (1024, 128)]
    assert [c.k for c in got][-2:] == [200, 200]
    by = {(c.m, c.n): c for c in got}  # shapes in order, n ascending
    assert by[(m, 128)].tile == other and by[(m, 128)].gain == pytest.approx(1.25)
    assert by[(m, 8)].tile == by[(m, 8)].rule == ws_config(8, m, k, SMS) and by[(m, 8)].gain == 1.0
    assert by[(tall[0], 8)].rule == sp_config(8, *tall, SMS) and by[(tall[0], 8)].tile == sp_other
    assert tiles.tuned_tile(0, 5, *tall, False, "cuda_sp") == sp_other and tiles.tuned_tile(0, 5, *tall, False) is None
    # K = 200 is held padded to 256 (0083): the tiles of K = 256 are timed, and kept for both.
    assert by[(1024, 8)].rule == ws_config(8, 1024, 256, SMS) and by[(1024, 8)].tile == by[(1024, 8)].rule
    assert tiles.tuned_tile(0, 8, 1024, 200, False) == tiles.tuned_tile(0, 8, 1024, 256, False) == by[(1024, 8)].tile
    assert tiles.tuned_tile(0, 125, m, k, False) == other  # n = 121 ... 128 take it
    assert [t[:3] for t in fake_hopper["timed"]] == [(8, m, k), (128, m, k), (8, *tall), (128, *tall),
                                                     (8, 1024, 256), (128, 1024, 256)]
    assert [len(t[3]) for t in fake_hopper["timed"]] == [tiles.DEFAULT_TOP] * 2 + [
        min(tiles.DEFAULT_TOP, len(sp_candidates(8, *tall, SMS))), tiles.DEFAULT_TOP] + [
        len(tiles.candidates(n, 1024, 256, SMS, False)) for n in (8, 128)]
    assert all(isinstance(c, SpConfig) for c in fake_hopper["timed"][2][3])


def test_a_second_tuning_reads_the_store_and_a_stale_entry_is_measured_again(fake_hopper, monkeypatch):
    m, k = 3072, 3072
    other = tiles.candidates(128, m, k, SMS, False)[2]
    fake_hopper["faster"][(m, k, 128)] = other
    kp.sparse24.tune_tiles([(m, k)], [128])
    tiles.clear_tuned_tiles()
    again = kp.sparse24.tune_tiles([(m, k)], [128])
    assert len(fake_hopper["timed"]) == 1 and again[0].source == "stored" and again[0].tile == other
    assert again[0].gain == pytest.approx(1.25) and tiles.tuned_tile(0, 128, m, k, False) == other
    # Under a rule that picks another tile today the stored choice is stale: measured again.
    today = tiles.candidates(128, m, k, SMS, False)
    monkeypatch.setattr(tiles, "candidates", lambda *a, **kw: today[1:] + today[:1])
    stale = kp.sparse24.tune_tiles([(m, k)], [128])
    assert len(fake_hopper["timed"]) == 2 and stale[0].source == "measured"


def test_store_false_neither_reads_nor_writes_the_plan_cache(fake_hopper):
    from kernelplan.cache import plan_cache

    kp.sparse24.tune_tiles([(4096, 4096)], [256], store=False)
    assert plan_cache().info()["entries"] == 0  # not written
    kp.sparse24.tune_tiles([(4096, 4096)], [256])  # stored
    kp.sparse24.tune_tiles([(4096, 4096)], [256], store=False)  # not read: timed again
    assert len(fake_hopper["timed"]) == 3 and plan_cache().info()["entries"] == 1


def test_a_gated_shape_is_tuned_over_gated_tiles_apart_from_the_plain_one(fake_hopper):
    kp.sparse24.tune_tiles([(2048, 1024, "gated_silu_first"), (2048, 1024)], [64])
    gated, plain = fake_hopper["timed"]
    assert all(gated_tile(c) for c in gated[3]) and set(gated[3]) != set(plain[3])
    assert tiles.tuned_tile(0, 64, 2048, 1024, True) == gated[3][0]
    assert tiles.tuned_tile(0, 64, 2048, 1024, False) == plain[3][0]


@pytest.mark.parametrize("kw, match", [({"top": 0}, "top and rounds"), ({"rounds": 0}, "top and rounds"),
                                       ({"min_gain": -0.1}, "min_gain 0 or more"),
                                       ({"device": "cpu"}, "pass a CUDA device")])
def test_bad_tuning_arguments_are_refused_before_anything_is_timed(fake_hopper, kw, match):
    with pytest.raises(InvalidProblem, match=match):
        kp.sparse24.tune_tiles([(4096, 4096)], [256], **kw)
    assert fake_hopper["timed"] == [] and tiles._TUNED == {}
