"""The gated epilogue of the 2:4 linear (``kp.sparse24.gated_linear``): act(gate) * other of W's two halves of rows,
in the kernels' epilogue (``cuda_ws``, ``cuda_sp``) and the reference; ``GatedMLP`` and Hugging Face's gated MLPs
on it (``nn/gated_siblings.py``)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, compiled_graphs, compiles_after_warmup, poisoned, recording_backend, sm90
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.errors import InvalidProblem
from kernelplan.nn.gated_siblings import activation_of, gated_mlp_of
from kernelplan.nn.routes import route_of
from kernelplan.sparse24 import compress, gated_linear, prune
from kernelplan.sparse24.plan import GemmSparse24Descriptor, GemmSparse24Plan

gpu = pytest.mark.gpu
KINDS = [("swiglu", "first", "none"), ("geglu", "second", "tanh"), ("geglu", "first", "none"),
         ("reglu", "second", "none"), ("glu", "first", "none")]


def _oracle(x, w, b, kind, gate, approximate):
    """fp64: the plain GEMM, then kernelplan.gated_activation."""
    z = x.double() @ w.double().T + (0 if b is None else b.double())
    return kp.gated_activation(z, kind, gate=gate, approximate=approximate)


def _baseline(x, w, b, kind, gate, approximate):
    """The same in x's dtype with torch's GEMM: the error bar of assert_close."""
    return kp.gated_activation(F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)), kind, gate=gate,
                               approximate=approximate)


@pytest.mark.parametrize("kind, gate, approximate", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "3-D", "strided"])
def test_reference_matches_fp64(kind, gate, approximate, dtype, layout, seed):
    h, k = 48, 192
    w = prune(torch.randn(2 * h, k, dtype=torch.float64)).to(dtype)
    b = torch.randn(2 * h).to(dtype)
    x = {"contiguous": lambda: torch.randn(7, k), "3-D": lambda: torch.randn(2, 3, k),
         "strided": lambda: torch.randn(k, 9).T}[layout]().to(dtype)
    y = gated_linear(x, compress(w), b, kind, gate, approximate)
    assert y.shape == (*x.shape[:-1], h) and y.dtype == dtype
    assert_close(y, _oracle(x, w, b, kind, gate, approximate), _baseline(x, w, b, kind, gate, approximate),
                 atol=FWD_ATOL[dtype])


def test_the_gate_half_is_the_one_named():
    """Swapping W's halves and the gate gives the same result; not swapping the gate does not."""
    w = prune(torch.randn(64, 64, dtype=torch.float64))
    x = torch.randn(5, 64, dtype=torch.float64)
    swapped = torch.cat([w[32:], w[:32]])
    a = gated_linear(x, compress(w), kind="swiglu", gate="first")
    torch.testing.assert_close(gated_linear(x, compress(swapped), kind="swiglu", gate="second"), a)  # BLAS order
    assert (gated_linear(x, compress(swapped), kind="swiglu", gate="first") - a).abs().max() > 0.1


def test_autograd_matches_finite_differences():
    # Two halves of 16 rows: finite differences take a forward pass per input element (64 x 128 took 14 s of CI).
    w24 = compress(prune(torch.randn(32, 64, dtype=torch.float64)))
    values = w24.values.clone().requires_grad_(True)
    b = torch.randn(32, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 64, dtype=torch.float64, requires_grad=True)
    for kind, gate, approximate in KINDS[:2]:
        fn = functools.partial(_call, metadata=w24.metadata, kind=kind, gate=gate, approximate=approximate)
        assert torch.autograd.gradcheck(fn, (x, values, b))


def _call(x, values, b, metadata, kind, gate, approximate):
    return gated_linear(x, kp.sparse24.Sparse24Weight(values, metadata), b, kind, gate, approximate)


def test_bad_inputs_are_refused_by_name():
    x = torch.randn(2, 64)
    odd = compress(prune(torch.randn(80, 64)))  # halves of 40 rows: not whole 16-row tiles
    with pytest.raises(InvalidProblem, match=r"M = 80 rows .*\(M % 32 == 0\); pad each half"):
        gated_linear(x, odd)
    w24 = compress(prune(torch.randn(64, 64)))
    with pytest.raises(InvalidProblem, match="kind is 'swish'"):
        gated_linear(x, w24, kind="swish")
    with pytest.raises(InvalidProblem, match="gate is 'up'"):
        gated_linear(x, w24, gate="up")
    with pytest.raises(InvalidProblem, match="only geglu has a tanh"):
        gated_linear(x, w24, kind="swiglu", approximate="tanh")
    with pytest.raises(InvalidProblem, match="last dimension must equal the weight's K = 64"):
        gated_linear(torch.randn(2, 32), w24)
    with pytest.raises(InvalidProblem, match="shape"):
        gated_linear(x, w24, torch.randn(32))  # the bias has M entries, both halves'
    with pytest.raises(InvalidProblem, match="Sparse24Weight"):
        gated_linear(x, torch.randn(64, 64))
    with pytest.raises(InvalidProblem, match="descriptor.activation is the gated epilogue"):
        GemmSparse24Plan.check_descriptor(GemmSparse24Descriptor(4, 80, 64, "f32", "gated_silu_first"))


def test_only_the_layout_kernels_and_the_reference_take_the_gated_epilogue():
    desc = GemmSparse24Descriptor(32, 4096, 4096, "bf16", "gated_silu_first", device="cuda:0")
    for name in ("triton", "triton_bfe", "triton_m128", "cuda_mma", "cuda_wg", "dense", "cusparselt"):
        assert "gated epilogue" in GemmSparse24Plan.registry.get(name).supports(desc), name
    assert GemmSparse24Plan.registry.get("reference").supports(desc) is None
    assert GemmSparse24Plan.registry.get("cuda_sp").gated and GemmSparse24Plan.registry.get("cuda_ws").gated


@pytest.mark.parametrize("sms", [114, 132])
def test_gated_tiles_for_every_sweep_shape_and_batch(sms):
    from kernelplan.kernels.sparse24_ws_rule import gated_tile, ws_candidates, ws_config

    for (m, k) in sweep_shapes():
        for n in BATCH_SIZES + (3, 200):
            cfg = ws_config(n, 2 * m, k, sms, gated=True)
            assert gated_tile(cfg) and cfg.wm % 2 == 0 and not cfg.sk, (n, m, k, cfg)
            assert cfg in ws_candidates(n, 2 * m, k)


def test_gated_variants_compile(compile_for):
    """NVRTC builds the gated epilogue of the warp-specialized kernel (clusters along M and K included), of its
    ping-pong variant and of the mma.sp kernel on a CPU machine; a one-warpgroup tile is refused at compile time."""
    from kernelplan.kernels.sparse24_sp import SpConfig, source as sp_source
    from kernelplan.kernels.sparse24_ws import source as ws_source
    from kernelplan.kernels.sparse24_ws_rule import WsConfig

    assert compile_for(ws_source(WsConfig(128, 2, 2, 2, 4), "bf16", True, "gated_silu_first"), "sm_90a")
    assert compile_for(ws_source(WsConfig(64, 2, 1, 1, 8), "f16", False, "gated_gelu_tanh_second"), "sm_90a")
    assert compile_for(ws_source(WsConfig(128, 2, stages=6, pp=True), "bf16", True, "gated_silu_second"), "sm_90a")
    assert compile_for(sp_source(SpConfig(2, 2, 2, 4, 4), "bf16", True, "gated_gelu_first"), "sm_80")
    with pytest.raises(Exception, match="as many 64-row blocks of W from each half"):
        compile_for(ws_source(WsConfig(64, 1, 1, 1, 8), "bf16", False, "gated_silu_first"), "sm_90a")


def test_the_probe_names_activations():
    assert activation_of(torch.nn.SiLU()) == "silu"
    assert activation_of(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_of(torch.nn.GELU()) == "gelu"
    assert activation_of(torch.nn.ReLU()) == "relu"
    assert activation_of(torch.nn.Tanh()) is None and activation_of(lambda t: t[:3]) is None
    assert activation_of(torch.nn.Linear(3, 3)) is None  # raises on the probe: not an activation


def test_gated_mlp_fuses_its_gate_once_sparsified(seed):
    mlp = kp.nn.GatedMLP(128, 64, kind="geglu", approximate="tanh", bias=True).double()
    model = torch.nn.Sequential(mlp)
    assert not mlp.fuses_gate()
    kp.sparsify(model, progress=False)
    assert mlp.fuses_gate()
    x = torch.randn(3, 5, 128, dtype=torch.float64)
    want = mlp.down(kp.gated_activation(mlp.gate_up(x), "geglu", gate="first", approximate="tanh"))
    torch.testing.assert_close(mlp(x), want)


def _llama(act="silu", seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, hidden_act=act)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_hf_gated_mlps_run_on_one_gemm_and_match_the_unfused_model(act):
    model = _llama(act)
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    ids = torch.randint(0, 100, (2, 9))
    route = gated_mlp_of(model.model.layers[0].mlp)
    assert route.activation == {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[act]
    with torch.no_grad():
        for _ in range(3):  # the watch, the first fused call (checked against the module's own), then fused
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert route.stats == {"own": 1, "fused": 2} and route.checked and route.off is None
    copied = copy.deepcopy(model)  # the route goes with the module it routes
    assert gated_mlp_of(copied.model.layers[0].mlp).mlp is copied.model.layers[0].mlp
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(plain.state_dict())


def _phi3(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Phi3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=100, pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg).eval()


def test_phi3s_fused_gate_up_runs_on_the_gated_epilogue():
    """Phi-3's MLP holds gate and up as one layer (gate_up_proj): no group to settle, the first call already fused
    (and checked against the module's own forward)."""
    model = _phi3()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    route = gated_mlp_of(model.model.layers[0].mlp)
    assert route.fused and route.activation == "silu"
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert route.stats == {"own": 0, "fused": 2} and route.checked
    assert set(model.state_dict()) == set(plain.state_dict())


def test_torch_compile_traces_the_mlps_own_forward_in_one_graph():
    """Under torch.compile a routed MLP is its own forward (each projection its own op), in one graph."""
    torch._dynamo.reset()
    model = _llama()
    kp.sparsify(model, progress=False)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 128)
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 4))), model(torch.randint(0, 100, (1, 4)))  # settled and checked
        route = gated_mlp_of(mlp)
        before = dict(route.stats)
        got, graphs = compiled_graphs(mlp, x)
        torch.testing.assert_close(got, type(mlp).forward(mlp, x))
    assert sum(g.count("kernelplan.sparse24_linear") for g in graphs) == 3 and route.stats == before


@gpu
def test_on_the_gpu_reduce_overhead_survives_the_groups_laying_out_after_the_compile():
    """Compiled with reduce-overhead before the sibling groups laid out their buffers: the next eager call lays them
    out, so the members' weights move, and cudagraph trees re-record the step inside a capture, the first call on the
    moved weights.  At 1188d72 that raised InvalidState (a held weight's launches built through derived_from, which
    refuses builds in a capture; docs/design/0078)."""
    torch._dynamo.reset()
    model = _llama().cuda().bfloat16()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, 100, (2, 9), device="cuda")
    layer = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        model(ids)  # the watch settles the groups; nothing laid out yet
        for _ in range(3):  # warm-up, then the graph recorded on each member's own storage
            compiled(ids)
        before = layer.values.data_ptr()
        model(ids)  # the first grouped call lays the buffers out
        assert layer.values.data_ptr() != before
        for _ in range(3):
            got = compiled(ids).logits.clone()
        want = plain(ids).logits
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


def test_a_compiled_model_guards_nothing_of_its_groups_and_routes():
    """Traced, a grouped layer and a routed MLP read none of their route's state, so dynamo guards none of it: those
    guards had been a reduce-overhead decode step's host work (docs/design/0078).  Routes swapped for new objects,
    and a route turned off, recompile nothing."""
    torch._dynamo.reset()
    model = _llama()
    kp.sparsify(model, progress=False)
    ids = torch.randint(0, 100, (2, 9))
    backend, graphs = recording_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        model(ids), model(ids)  # settled and checked
        want = compiled(ids).logits
        swapped = 0
        for mod in model.modules():
            if "_siblings" in mod.__dict__:
                mod.__dict__["_siblings"] = copy.copy(mod.__dict__["_siblings"])
                swapped += 1
            if route_of(mod) is not None:
                route_of(mod).off, route_of(mod).stats = "off", {}
                swapped += 1
        got = compiled(ids).logits
    assert swapped == 2 * (4 + 2 + 1) and len(graphs) == 1  # a layer: q/k/v/o, gate/up and the MLP's route
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_warmup_lists_the_gated_gemms_once_their_groups_settle():
    from kernelplan.warm import table

    model = _llama()
    kp.sparsify(model, progress=False)
    with torch.no_grad():
        assert not any("epilogue" in r for r in kp.warmup(model, batch_sizes=(1, 8), progress=False))  # watching
        model(torch.randint(0, 100, (1, 4)))
        rows = kp.warmup(model, batch_sizes=(1, 8), progress=False)
    gated = [r for r in rows if r.get("epilogue")]
    assert [(r["m"], r["k"], r["n"], r["epilogue"], r["expected"]) for r in gated] == \
        [(512, 128, 1, "gated_silu_first", None), (512, 128, 8, "gated_silu_first", None)]
    assert "(gated_silu_first)" in table(rows)


def test_hf_mlp_under_autograd_runs_its_own_forward():
    model = _llama()
    kp.sparsify(model, progress=False)
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        model(ids), model(ids)
    route = gated_mlp_of(model.model.layers[0].mlp)
    before = dict(route.stats)
    model(ids).logits.sum().backward()
    assert route.stats["own"] == before["own"] + 1 and route.stats["fused"] == before["fused"]
    assert model.model.layers[0].mlp.up_proj.values.grad is not None


def test_a_forward_that_is_not_act_gate_times_up_goes_back_to_its_own():
    model = _llama()
    mlp_cls = type(model.model.layers[0].mlp)

    class Swapped(mlp_cls):
        def forward(self, x):  # gate_proj read first, as Llama's, but the activation on the other
            gate = self.gate_proj(x)
            return self.down_proj(gate * self.act_fn(self.up_proj(x)))

    for layer in model.model.layers:
        layer.mlp.__class__ = Swapped
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    ids = torch.randint(0, 100, (2, 7))
    with pytest.warns(RuntimeWarning, match="not run on one gated GEMM"), torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    route = gated_mlp_of(model.model.layers[0].mlp)
    assert route is not None and route.off is not None and route.stats["fused"] == 0


# -- on the GPU ---------------------------------------------------------------------------------------------------

GPU_CASES = [(1, 256, 512), (16, 4096, 1024), (40, 272, 2048), (64, 1024, 4096), (130, 1376, 1024),
             (300, 512, 4096), (777, 2048, 768), (2048, 512, 1024)]


@gpu
@pytest.mark.parametrize("kind, gate, approximate", KINDS[:2])
@pytest.mark.parametrize("n, h, k", GPU_CASES, ids=[f"n{c[0]}-h{c[1]}-k{c[2]}" for c in GPU_CASES])
def test_gated_linear_on_the_gpu_matches_fp64(n, h, k, kind, gate, approximate, seed):
    """By rule (cuda_sp at small n on tall weights, else cuda_ws on Hopper; cuda_sp everywhere on Ampere), the
    halves' boundary off a CTA's rows (h = 272, 1376), bias, 3-D x."""
    w = prune(torch.randn(2 * h, k, device="cuda")).bfloat16()
    b = torch.randn(2 * h, device="cuda").bfloat16()
    x = torch.randn(1, n, k, device="cuda").bfloat16()
    y = gated_linear(x, compress(w), b, kind, gate, approximate)
    assert_close(y, _oracle(x, w, b, kind, gate, approximate), _baseline(x, w, b, kind, gate, approximate),
                 atol=FWD_ATOL[torch.bfloat16])


@gpu
@sm90
@pytest.mark.parametrize("n, m, k", [(200, 1024, 2048), (77, 544, 1024), (300, 1056, 4096), (16, 4096, 1024),
                                     (90, 544, 1600)])
def test_every_gated_tile_matches_fp64(n, m, k, seed):
    """Each tile the gated rule may pick (N tiles of every size, clusters along M and K, K splits of 25 steps into
    slices one step apart, ping-pong), rows past M / 2."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24_sp import _tiled
    from kernelplan.kernels.sparse24_ws import WsKernel
    from kernelplan.kernels.sparse24_ws_rule import gated_tile, ws_candidates

    w = prune(torch.randn(m, k, device="cuda")).bfloat16()
    w24 = compress(w)
    pairs, codes = _tiled(w24.values, w24.metadata)
    b = torch.randn(m, device="cuda").bfloat16()
    x = torch.randn(n, k, device="cuda").bfloat16()
    ref, base = _oracle(x, w, b, "swiglu", "first", "none"), _baseline(x, w, b, "swiglu", "first", "none")
    kernel = WsKernel()
    tiles = [c for c in ws_candidates(n, m, k, between=True) if gated_tile(c)]
    assert {c.cm for c in tiles} >= {1, 2} and any(c.pp for c in tiles) and len(tiles) > 3
    for cfg in tiles:
        y = poisoned((n, m // 2), torch.bfloat16, "cuda")
        launch, grid = kernel.launch_config(cfg, n, m, "bf16", True, "gated_silu_first", 0)
        launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, k,
                      x.stride(0), y.stride(0)), raw_stream(0))
        assert_close(y, ref, base, atol=FWD_ATOL[torch.bfloat16], what=str(cfg))


@gpu
@pytest.mark.parametrize("n", [1, 16, 64, 100])
def test_gated_mma_sp_matches_fp64(n, seed):
    """cuda_sp by name: its gated epilogue at each N tile, and past 64 rows in chunks."""
    w = prune(torch.randn(1024, 2048, device="cuda")).half()
    x = torch.randn(n, 2048, device="cuda").half()
    pref = kp.plan.PlanPreference.only("cuda_sp")
    desc = GemmSparse24Descriptor(n, 1024, 2048, "f16", "gated_gelu_tanh_second", device="cuda:0")
    plan = GemmSparse24Plan.select(desc, pref)
    w24 = compress(w)
    y = poisoned((n, 512), torch.float16, "cuda")
    plan.run(kp.sparse24.GemmSparse24Args(x, w24.values, w24.metadata, y))
    assert_close(y, _oracle(x, w, None, "geglu", "second", "tanh"), _baseline(x, w, None, "geglu", "second", "tanh"),
                 atol=FWD_ATOL[torch.float16])


@gpu
@pytest.mark.parametrize("build", [_llama, _phi3], ids=["llama", "phi3"])
def test_hf_gated_mlp_on_the_gpu_eager_and_in_a_graph(build):
    """A Llama's MLPs (a gate/up group) and a Phi-3's (one gate_up layer) on the gated GEMM: the same logits as the
    unfused model, eagerly and replayed from a CUDA graph captured after the gated GEMM ran once; the weights held
    once (the route keeps no layout of its own)."""
    from kernelplan.bench.decode import weight_bytes

    model = build().cuda().bfloat16()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    ids = torch.randint(0, 100, (2, 33), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            got, want = model(ids).logits, plain(ids).logits
        route = gated_mlp_of(model.model.layers[0].mlp)
        assert route.stats["fused"] == (3 if route.fused else 2) and route.checked
        assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())
        assert weight_bytes(model) == weight_bytes(plain)
        graph, static = torch.cuda.CUDAGraph(), ids.clone()
        with torch.cuda.graph(graph):
            out = model(static).logits
        fused = route.stats["fused"]
        graph.replay()
        torch.testing.assert_close(out, got, rtol=0, atol=0)
        assert fused == (4 if route.fused else 3)  # the capture ran the gated GEMM


@gpu
def test_on_the_gpu_warmup_builds_the_gated_mlps_kernels(monkeypatch, tmp_path):
    """After the first pass settles the groups, ``kp.warmup`` compiles the gated GEMMs too: calls at the warmed
    sizes compile nothing."""
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    model = _llama().cuda().bfloat16()
    kp.sparsify(model, progress=False)
    with torch.inference_mode():
        model(torch.randint(0, 100, (1, 4), device="cuda"))  # the first pass settles the groups
    assert compiles_after_warmup(model) == 0
    assert gated_mlp_of(model.model.layers[0].mlp).stats["fused"] == 3


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_on_the_gpu_a_compiled_llama_with_settled_groups_matches_the_unfused_model(mode):
    """Compiled after its groups settled and its gated routes were checked (each layer its own op when traced):
    inductor's kernels and CUDA graphs around the 2:4 ops, the unfused model's logits at three batch sizes."""
    torch._dynamo.reset()
    model = _llama().cuda().bfloat16()
    plain = copy.deepcopy(model)
    kp.sparsify(model, progress=False)
    kp.sparsify(plain, progress=False, fuse=False)
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 100, (2, 9), device="cuda"))  # settled, laid out and checked
        assert gated_mlp_of(model.model.layers[0].mlp).checked
        for shape in [(1, 1), (3, 17), (2, 64), (3, 17)]:
            ids = torch.randint(0, 100, shape, device="cuda")
            for _ in range(3):  # reduce-overhead: warm-up runs, then the graph's replays
                got = compiled(ids).logits.clone()
            want = plain(ids).logits
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max()), shape
