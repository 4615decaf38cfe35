"""The grouped kernel's epilogues (``kernels/sparse24_grouped.py``): a MoE layer's first projection and its gating as
one launch over every expert.  CPU: its variants compile, and its gated tensor maps read each expert's two halves as
one expert's own gated maps do (the copy engine's boxes emulated).  GPU: against fp64."""

from __future__ import annotations

import copy

import pytest
import torch

from kernelplan.nn import Sparse24Experts

from helpers import FWD_ATOL, assert_close, sm90
from test_experts import _routing, replay_on_new_routing

transformers = pytest.importorskip("transformers")
gpu = pytest.mark.gpu


def _box(buffer: torch.Tensor, address: int, dims, strides, box, coords) -> torch.Tensor:
    """What a tiled tensor map's copy writes (``cuTensorMapEncodeTiled`` of 4-byte elements; dims, strides in bytes
    past the first, box and coords innermost first) from ``buffer``'s words at byte ``address``: the box, outermost
    first, zeros where it runs past a dimension."""
    index = torch.zeros((), dtype=torch.long)
    inside = torch.ones((), dtype=torch.bool)
    for d, (size, at) in enumerate(zip(box, coords)):
        pos = (torch.arange(size) + at).view([-1] + [1] * d)
        index = index.unsqueeze(0) + pos * ([4] + list(strides))[d]
        inside = inside.unsqueeze(0) & (pos < dims[d])
    words = (address + index) // 4
    return torch.where(inside, buffer[words.clamp(max=buffer.numel() - 1)], 0)


def _maps(monkeypatch, rows, tiles):
    """A gated ``TensorMaps`` whose maps are their encoding arguments."""
    pytest.importorskip("cuda.bindings.driver")
    from kernelplan.kernels import sparse24_ws

    monkeypatch.setattr(sparse24_ws, "encode_tensor_map",
                        lambda cu, dtype, address, dims, strides, box, swizzle: (address, dims, strides, box))
    return sparse24_ws.TensorMaps(rows, tiles, "bf16", gated=True)


@pytest.mark.parametrize("half_rows", [64, 96, 144])  # whole 64-row blocks, and halves that end inside one
def test_grouped_gated_maps_read_each_expert_as_its_own_maps_do(monkeypatch, half_rows, seed):
    """Expert e's box at (block, half 2 e) of the grouped maps holds what expert e's own gated maps' box at (block,
    half 0) does, every block and step: its gate tiles then its up tiles, zeros past each half, never a neighbour's
    rows (``sparse24_ring.cuh``, load_w)."""
    experts, k, tiles = 3, 192, 8  # a 128-row tile: 4 16-row tiles from each half
    m, steps = 2 * half_rows, k // 64
    values = torch.randint(1, 2**30, (experts * m // 16 * steps * 256,), dtype=torch.int32)
    codes = torch.randint(1, 2**30, (experts * m // 16 * steps * 32,), dtype=torch.int32)
    maps = _maps(monkeypatch, 64, tiles)
    grouped_v, grouped_e = maps.w(0, 0, experts * m, k, groups=experts)
    blocks = -(-half_rows // (16 * tiles // 2))
    for e in range(experts):
        at_v, at_e = e * values.numel() // experts * 4, e * codes.numel() // experts * 4
        own_v, own_e = maps.w(at_v, at_e, m, k)
        for block in range(blocks):
            for step in range(steps):
                for (address, *geometry), own, buffer, coords in (
                        (grouped_v, own_v, values, lambda h: (0, block * tiles // 2, h, 0, step)),
                        (grouped_e, own_e, codes, lambda h: (0, step, block * tiles // 2, h))):
                    got = _box(buffer, address, *geometry, coords(2 * e))
                    want = _box(buffer, own[0], *own[1:], coords(0))
                    assert torch.equal(got, want), (e, block, step)
                    assert (got != 0).any()
    # The box of the last expert's last block stops at its halves: the rows past them are zeros.
    if half_rows % 64:
        got = _box(values, grouped_v[0], *grouped_v[1:], (0, (blocks - 1) * tiles // 2, 2 * experts - 2, 0, 0))
        assert (got[..., half_rows // 16 % 4:, :] == 0).all() and (got[..., :half_rows // 16 % 4, :] != 0).all()


class _NamedMaps:
    """TensorMaps' two lookups, each map 128 bytes naming what it maps."""

    def x(self, x, n, k, stride):
        return f"x {x:#x} {n} {k} {stride}".encode().ljust(128, b".")

    def w(self, values, codes, m, k, groups=1):
        return (f"v {values:#x} {m} {k} {groups}".encode().ljust(128, b"."),
                f"e {codes:#x} {m} {k} {groups}".encode().ljust(128, b"."))


@pytest.mark.parametrize("rows, epilogue, scatter", [(40, "gated_silu_first", False), (3000, None, True)],
                         ids=["ping-pong gated", "one-a-cta scattered"])
def test_grouped_calls_pack_their_operands_into_one_bound_launch(monkeypatch, rows, epilogue, scatter):
    """``grouped_linear`` binds a launch per projection and row count (``GroupedBound``): each call's x map, y, offsets
    (and the scattered store's rows and scales) land in their slots, everything else as bound, on the tiles' grid."""
    import struct

    from helpers import stub_driver
    from kernelplan.activations import GATED_EPILOGUES
    from kernelplan.kernels import direct, sparse24, sparse24_grouped as g
    from kernelplan.kernels.sparse24_ws import _PARAMS, _PP_PARAMS

    experts, m, k = 6, 256, 192
    gated = epilogue in GATED_EPILOGUES
    cfg = g.grouped_config(m, rows, experts, gated)
    assert cfg.pp == (rows == 40)
    types = (_PP_PARAMS if cfg.pp else _PARAMS) + g._GROUP_PARAMS + g._SCATTER_PARAMS * scatter
    stub = stub_driver(monkeypatch, types)
    launch, maps = direct.FunctionLaunch("fn", "kp", types, cfg.threads, cfg.shared), _NamedMaps()
    monkeypatch.setattr(g, "_launcher", lambda *args: (launch, maps))
    monkeypatch.setattr(sparse24, "sm_count", lambda device: 132)
    monkeypatch.setattr(g, "raw_stream", lambda device: 3)
    monkeypatch.setattr(g, "_BOUND", {})
    values = torch.zeros(experts * m // 16, k // 64, 256, dtype=torch.int32)
    metadata = torch.zeros(experts * m // 16, k // 64, 32, dtype=torch.int32)
    bias = torch.zeros(experts, m, dtype=torch.bfloat16)
    kept = []  # every call's operands stay alive, so that each call's addresses are new
    for _ in range(3):
        x, offsets = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(experts + 1, dtype=torch.int32)
        pairs, order, scale = torch.zeros(rows, m, dtype=torch.bfloat16), torch.zeros(rows, dtype=torch.int64), \
            torch.zeros(rows)
        y = g.grouped_linear(x, values, metadata, bias, offsets, experts, epilogue,
                             (pairs, order, scale) if scatter else None)
        kept.append((x, offsets, pairs, order, scale, y))
        assert y.shape == (rows, m // 2 if gated else m) and (y is pairs) == scatter
        want = (maps.x(x.data_ptr(), rows, k, k), *maps.w(values.data_ptr(), metadata.data_ptr(), experts * m, k,
                                                           experts if gated else 1),
                bias.data_ptr(), y.data_ptr(), rows, m, k, y.stride(0)) + (0,) * cfg.pp + \
            (offsets.data_ptr(), experts) + ((order.data_ptr(), scale.data_ptr()) if scatter else ())
        grid, block, shared, stream, slots = stub.launches[-1]
        assert slots == [struct.pack("<" + code, value)[:direct._slot_code(ty)[1]]
                         for code, value, ty in zip(launch._codes, want, types)]
        tiles = (-(-rows // cfg.bn) + experts) * -(-m // cfg.rows)
        assert grid == (min(132, tiles) if cfg.pp else tiles, 1, 1) and (block, shared) == (cfg.threads, cfg.shared)
        assert stream == ("stream", 3)
    assert len(g._BOUND) == 1 and len({call[0].data_ptr() for call in kept}) == 3


def test_a_grouped_launch_bound_on_one_device_is_not_taken_on_another(monkeypatch):
    """A bound launch holds a kernel loaded into one device's context.  The same weights' addresses seen from another
    device (memory given back and its addresses handed to another device) bind a launch of that device's kernel,
    launched there; a second call on each device takes its own."""
    import contextlib

    from helpers import stub_driver
    from kernelplan.kernels import direct, sparse24, sparse24_grouped as g

    experts, m, k, rows = 6, 256, 192, 40
    cfg = g.grouped_config(m, rows, experts, False)
    types = (g._PP_PARAMS if cfg.pp else g._PARAMS) + g._GROUP_PARAMS
    stub_driver(monkeypatch, types)
    loaded, current = [], []  # the device each kernel was loaded for; the device current at each launch
    launch = direct.FunctionLaunch("fn", "kp", types, cfg.threads, cfg.shared)
    monkeypatch.setattr(g, "_launcher", lambda *args: loaded.append(args[-1]) or (launch, _NamedMaps()))
    monkeypatch.setattr(g, "on_device", lambda index: current.append(index) or contextlib.nullcontext())
    monkeypatch.setattr(sparse24, "sm_count", lambda device: 132)
    monkeypatch.setattr(g, "raw_stream", lambda device: 3)
    monkeypatch.setattr(g, "_BOUND", {})
    device = [0]
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: device[0])  # CPU tensors standing in for each GPU's
    values = torch.zeros(experts * m // 16, k // 64, 256, dtype=torch.int32)
    metadata = torch.zeros(experts * m // 16, k // 64, 32, dtype=torch.int32)
    x, offsets = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(experts + 1, dtype=torch.int32)
    for device[0] in (0, 1, 0, 1):
        g.grouped_linear(x, values, metadata, None, offsets, experts)
    assert loaded == [0, 1] and current == [0, 1, 0, 1] and len(g._BOUND) == 2


def test_grouped_variants_compile(compile_for):
    """NVRTC builds the grouped kernel plain, under an activation and under a gated epilogue, with and without biases,
    in both dtypes, and its scattered store, ping-pong and (256 rows of x a tile) one a CTA, on a CPU machine."""
    from kernelplan.kernels.sparse24_grouped import grouped_config
    from kernelplan.kernels.sparse24_ws import source

    for (m, s, gated), dtype, bias, epilogue, scatter in (((256, 300, False), "bf16", False, None, False),
                                                         ((192, 5, False), "f16", True, "gelu_tanh", False),
                                                         ((192, 40, True), "bf16", True, "gated_silu_first", False),
                                                         ((512, 3000, True), "f16", False, "gated_gelu_second", False),
                                                         ((192, 70, False), "bf16", True, None, True),
                                                         ((512, 5000, True), "bf16", True, "gated_silu_first", False),
                                                         ((192, 5000, False), "f16", True, None, True)):
        cfg = grouped_config(m, s, 8, gated)
        assert cfg.wm == (2 if gated or m % 128 == 0 else 1) and cfg.pp == (cfg.bn < 256)
        assert compile_for(source(cfg, dtype, bias, epilogue, True, scatter), "sm_90a")


def _mixtral_experts(dtype, hidden=128, inner=192, experts=4, act="silu"):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts, hidden_act=act)
    cfg._experts_implementation = "eager"
    mod = MixtralExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.05)
    return mod


def test_the_first_projection_s_epilogue_is_its_gating_or_activation(seed):
    """Mixtral's default gating is the gated epilogue; experts without a gate take their activation; a gating of the
    module's own (gpt-oss's clamp and interleave) is not one the kernels compute."""
    sparse = Sparse24Experts.from_experts(_mixtral_experts(torch.float32, act="gelu_pytorch_tanh"))
    assert sparse._epilogue == "gated_gelu_tanh_first"
    ungated = copy.copy(sparse)
    ungated.has_gate = False
    assert ungated._first_epilogue() == "gelu_tanh"
    own = copy.copy(sparse)
    own._gate = lambda module, h: h[..., ::2] * h[..., 1::2]
    assert own._first_epilogue() is None


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# The down projection's K (the intermediate size) is a multiple of 64 on the grouped kernel, so a module's halves are
# whole 64-row blocks: one and a half tiles of 128 rows, and five.  (Halves that end inside a block: grouped_linear's
# own test below.)
@pytest.mark.parametrize("inner", [192, 320])
def test_grouped_gated_experts_match_fp64_eager_and_in_a_graph(dtype, inner, seed):
    """Mixtral's experts on the grouped kernel with the gating in the first launch's epilogue, against the fp64
    oracle of the same pruned weights, at token counts that leave experts empty, partly filled boxes and many tiles;
    the unfused module's output beside it; then captured in a CUDA graph and replayed on new routing."""
    dense = _mixtral_experts(torch.float64, inner=inner, experts=6)
    sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).to(dtype)).cuda()
    assert sparse._epilogue == "gated_silu_first"
    unfused = copy.copy(sparse)
    unfused._epilogue = None
    oracle = copy.deepcopy(dense)
    with torch.no_grad():
        for e in range(6):
            oracle.gate_up_proj[e] = sparse.first[e].to_dense().double().cpu()
            oracle.down_proj[e] = sparse.down[e].to_dense().double().cpu()
    for tokens in (1, 37, 300, 1500):  # ... 1500: 500 rows an expert, tiles of 256 rows (one a CTA)
        x = torch.randn(tokens, 128, dtype=torch.float64)
        index, weights = _routing(tokens, 6)
        with torch.no_grad():
            want = oracle(x, index, weights.double())
            xd, index, weights = x.to(dtype).cuda(), index.cuda(), weights.to(dtype).cuda()
            assert sparse._grouped(xd)
            out, base = sparse(xd, index, weights), unfused(xd, index, weights)
        assert_close(out, want.cuda(), base, atol=FWD_ATOL[dtype])
    with torch.no_grad():
        replay_on_new_routing(sparse, xd, index, weights, 6)


@gpu
@sm90
@pytest.mark.parametrize("bounds", [[0, 0, 70, 73, 73, 223], [0, 0, 600, 603, 603, 1500]],
                         ids=["ping-pong", "one-a-cta"])  # 47 and 302 rows an expert on average
def test_grouped_linear_under_a_gated_epilogue_with_biases_and_an_activation_and_scattered(bounds, seed):
    """``grouped_linear`` itself: biases [E, M] under the gated epilogue (each expert's bias halves paired as its
    rows are), a plain activation, and the scattered store (each row weighted into its pair's row), against fp64;
    experts with no rows, a few, and many, and rows of x past the last offset."""
    import torch.nn.functional as F

    from kernelplan.kernels.sparse24_grouped import grouped_config, grouped_linear
    from kernelplan.nn import Sparse24Linear
    from kernelplan.sparse24.format import prune_compress

    experts, m, k = 5, 192, 256
    layers = []
    for _ in range(experts):
        w24 = prune_compress(torch.randn(m, k).bfloat16().cuda(), packed=True)
        layers.append(Sparse24Linear(w24.values, w24.metadata, torch.randn(m).bfloat16().cuda()))
    holder = Sparse24Experts(layers, copy.deepcopy(layers), torch.nn.SiLU())
    values, metadata, bias = holder._span(holder.first)
    offsets = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    assert grouped_config(m, bounds[-1] + 9, experts).pp == (bounds[-1] < 1000)
    x = torch.randn(bounds[-1] + 9, k, dtype=torch.float64)
    z = torch.cat([F.linear(x[a:b], layers[e].to_dense().double().cpu(), layers[e].bias.double().cpu())
                   for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    zb = torch.cat([F.linear(x[a:b].bfloat16().cuda(), layers[e].to_dense(), layers[e].bias)
                    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
    xd = x.bfloat16().cuda()
    with torch.no_grad():
        y = grouped_linear(xd, values, metadata, bias, offsets, experts, "gated_silu_first")
        plain = grouped_linear(xd, values, metadata, bias, offsets, experts, "relu")
    assert y.shape == (x.shape[0], m // 2) and plain.shape == (x.shape[0], m)
    rows, h = bounds[-1], m // 2
    assert_close(y[:rows], (F.silu(z[:, :h]) * z[:, h:]).cuda(), F.silu(zb[:, :h]) * zb[:, h:],
                 atol=FWD_ATOL[torch.bfloat16])
    assert_close(plain[:rows], z.clamp(min=0).cuda(), zb.clamp(min=0), atol=FWD_ATOL[torch.bfloat16])

    # Scattered: row n to row rows[n] of a given y, times scale[rows[n]]; rows past the last offset leave theirs.
    total = x.shape[0]
    rows_of = torch.randperm(total, device="cuda")
    scale = torch.rand(total, device="cuda")
    y = torch.full((total, m), 7.0, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = grouped_linear(xd, values, metadata, bias, offsets, experts, scatter=(y, rows_of, scale))
    assert got is y
    placed = rows_of[:rows].cpu()
    want = z * scale.double().cpu()[placed, None]
    base = zb * scale[rows_of[:rows], None].bfloat16()
    assert_close(y[rows_of[:rows]], want.cuda(), base, atol=FWD_ATOL[torch.bfloat16])
    assert (y[rows_of[rows:]] == 7.0).all()


def test_warmup_has_a_variant_for_each_width_of_x_s_tile(compile_for):
    """``grouped_variants``: one tile for each width ``grouped_config`` can pick, 128 rows of W under a gated
    epilogue, each compiling on a CPU machine."""
    from kernelplan.kernels.sparse24_grouped import GROUPED_ROWS, grouped_config, grouped_variants

    variants = grouped_variants(192, torch.bfloat16, True, "gated_silu_first")
    assert [cfg.bn for cfg, _ in variants] == list(GROUPED_ROWS) and all(cfg.wm == 2 for cfg, _ in variants)
    picked = {grouped_config(192, s, 8, True) for s in (1, 9, 200, 300, 600, 2049, 5000)}
    assert picked == {cfg for cfg, _ in variants}
    assert grouped_config(192, 2048, 8).bn == 128 and grouped_config(192, 2049, 8).bn == 256  # 256 a tile: > 256
    assert len(variants[0][1]()) > 0


@gpu
@sm90
def test_after_warmup_a_moe_model_s_grouped_calls_compile_nothing(monkeypatch, tmp_path, seed):
    """``kp.warmup`` builds both projections' grouped tiles in place of the per-expert layers; then forwards at token
    counts from a decode's to a prefill's compile nothing."""
    import kernelplan as kp
    from kernelplan.kernels import nvrtc
    from kernelplan.kernels.moe_route import _ROUTE, _SCAN
    from kernelplan.kernels.sparse24_grouped import GROUPED_ROWS
    from transformers import MixtralConfig, MixtralForCausalLM

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    cfg = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    kp.sparsify(model, progress=False, experts="all")
    rows = kp.warmup(model, batch_sizes=(1, 16), progress=False)
    grouped = [r for r in rows if r["backend"] == "grouped"]
    assert sorted((r["m"], r["k"], r["n"]) for r in grouped) == sorted(
        (m, k, n) for m, k in ((384, 128), (128, 192)) for n in GROUPED_ROWS)
    assert not any(r["m"] == 384 and r["backend"] != "grouped" for r in rows)  # no per-expert first projection
    compiles, routes, scans = nvrtc.COMPILES[0], dict(_ROUTE._compiled), dict(_SCAN._compiled)  # routing: Triton's
    with torch.inference_mode():
        for tokens in (1, 5, 64, 700):
            model(torch.randint(0, 256, (1, tokens), device="cuda"))
        assert nvrtc.COMPILES[0] == compiles
        # 2200 pairs, whose counts the scan launch sums.  (The attention layers' own tiles for 1100 rows are not
        # among warmup's batch sizes: NVRTC may build one here.)
        model(torch.randint(0, 256, (1, 1100), device="cuda"))
    assert _ROUTE._compiled == routes and _SCAN._compiled == scans and scans
