"""Experts modules that run every token through every expert (``nn/experts.py``'s ``EVERY_TOKEN``: Llama-4's) held
2:4: ``Sparse24Experts`` with ``every_token``, its forward ``(hidden_states [E T, H])`` each expert's T rows in turn.

CPU: the module against the source holding the pruned weights (float64), the routing Llama-4's MoE gives it, odd and
non-contiguous inputs; error inputs; calibration's rows for each expert; a fullgraph compile.  GPU: the grouped
kernel with offsets ``0, T, 2T ...`` against the fp64 oracle, a CUDA graph, a compiled call, a sparsified model."""

from __future__ import annotations

import copy

import pytest
import torch

import kernelplan as kp
from kernelplan.errors import InvalidProblem
from kernelplan.nn import Sparse24Experts

from helpers import FWD_ATOL, assert_close, sm90
from test_experts import _dense_twin

transformers = pytest.importorskip("transformers")
llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
gpu = pytest.mark.gpu


def _experts(dtype, experts=4, hidden=128, inner=192):
    config = transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=experts,
                                           hidden_act="silu")
    module = llama4.Llama4TextExperts(config)
    with torch.no_grad():  # the class leaves gate_up_proj zero and down_proj uninitialized
        module.gate_up_proj.copy_(torch.randn_like(module.gate_up_proj) / hidden ** 0.5)
        module.down_proj.copy_(torch.randn_like(module.down_proj) / inner ** 0.5)
    return module.to(dtype)


def _routed(tokens: int, experts: int, hidden: int = 128, top_k: int = 1, dtype=torch.float64, skip=()):
    """What Llama4TextMoe gives its experts: the tokens repeated once an expert, each copy times the router's sigmoid
    score for that expert, zero where the expert is not among the token's top ``top_k`` (never one of ``skip``)."""
    x = torch.randn(tokens, hidden, dtype=dtype)
    logits = torch.randn(tokens, experts, dtype=torch.float64)
    logits[:, list(skip)] = -torch.inf
    top, index = torch.topk(logits, top_k, dim=1)
    scores = torch.full_like(logits, -torch.inf).scatter_(1, index, top).sigmoid().to(dtype)
    return x.repeat(experts, 1) * scores.t().reshape(-1, 1), index


def _routed_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A model with its Llama-4 MoE layers routed (nn/moe_routes.py) against the module's own forward, in float64.
    The router's scores are float32 (Llama4Router's sigmoid of ``.float()``), and torch's CPU sigmoid rounds the
    route's [T, k] and the router's [T, E] a unit of float32's last place apart now and then (6e-8 of a score): 1e-6
    of the largest value.  All else is float64; a wrong expert or a missing score is off by the values' order."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def _oracle(dense: torch.nn.Module, sparse: Sparse24Experts) -> torch.nn.Module:
    """``dense`` (float64) holding the 2:4 module's pruned weights."""
    oracle = copy.deepcopy(dense).double()
    with torch.no_grad():
        for e in range(sparse.num_experts):
            oracle.gate_up_proj[e] = sparse.first[e].to_dense().t().double().cpu()
            oracle.down_proj[e] = sparse.down[e].to_dense().t().double().cpu()
    return oracle


def test_every_token_experts_compute_the_source_module_on_the_pruned_weights(seed):
    dense = _experts(torch.float64)
    sparse = Sparse24Experts.from_experts(dense)
    assert sparse.every_token and sparse.num_experts == 4
    shapes = [(m.out_features, m.in_features) for m in (sparse.first[0], sparse.down[0])]
    assert shapes == [(384, 128), (128, 192)]  # Llama-4's [E, in, out] weights as linear layers' [out, in]
    # kp.warmup's launches: the down projection's every-token one, and its routed calls' scattered store.
    assert [(m, k, scatter) for m, k, _, _, scatter in sparse.grouped_gemms()] == [
        (384, 128, False), (128, 192, False), (128, 192, True)]
    oracle = _oracle(dense, sparse)
    wide = torch.randn(4 * 5, 300, dtype=torch.float64)
    inputs = [_routed(tokens, 4, top_k=k)[0] for tokens, k in ((0, 1), (1, 1), (7, 1), (33, 2))]
    inputs.append(wide[:, 17:145])  # rows 300 apart: not contiguous
    with torch.no_grad():
        for x in inputs:
            got = sparse(x)
            assert got.shape == x.shape and got.dtype == x.dtype
            torch.testing.assert_close(got, oracle(x), rtol=1e-10, atol=1e-10)
    # The weights are 2 of every 4 along each expert's inputs, and differ from the dense ones.
    w = sparse.first[2].to_dense()
    assert ((w.view(384, 32, 4) != 0).sum(-1) <= 2).all()
    assert not torch.equal(w, dense.gate_up_proj[2].t())


@pytest.mark.parametrize("top_k", [1, 2])
def test_routed_calls_weigh_each_pair_s_input_as_llama4_s_moe_does(seed, top_k):
    """``routed(..., weigh=...)``: each chosen expert on its token scaled by the weight ("inputs") or by the sigmoid
    of it in float32, rounded to its dtype ("sigmoid inputs": the router's top logits), summed; against the oracle
    run on every expert's scaled copies, as Llama4TextMoe runs it (float64, odd token counts, a strided x)."""
    from kernelplan.kernels.moe_route import WEIGHINGS
    from kernelplan.nn.experts import INPUT_WEIGHTS

    assert set(WEIGHINGS) == {"outputs", *INPUT_WEIGHTS}  # the kernel's names are the module's
    dense = _experts(torch.float64, experts=5)
    sparse = Sparse24Experts.from_experts(dense)
    oracle = _oracle(dense, sparse)
    for tokens in (0, 1, 7, 33):
        hidden = torch.randn(tokens, 200, dtype=torch.float64)[:, 40:168]  # rows 200 apart
        logits = torch.randn(tokens, 5, dtype=torch.float64)
        top, index = torch.topk(logits, top_k, dim=1)
        for weigh, scale in (("inputs", top), ("sigmoid inputs", torch.sigmoid(top.float()).double())):
            scores = torch.zeros_like(logits).scatter_(1, index, scale)  # zero for the experts not chosen
            want = oracle(hidden.repeat(5, 1) * scores.t().reshape(-1, 1)).view(5, tokens, 128).sum(0)
            with torch.no_grad():
                got = sparse.routed(hidden, index, top, weigh=weigh)
            assert got.shape == (tokens, 128) and got.dtype == torch.float64
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(InvalidProblem, match="weigh 'input': the routing weights scale the experts' outputs "
                                             "\\(\"outputs\"\\) or their inputs \\('inputs', 'sigmoid inputs'\\)"):
        sparse.routed(hidden, index, top, weigh="input")


def test_error_inputs_are_refused_with_what_the_experts_take(seed):
    sparse = Sparse24Experts.from_experts(_experts(torch.float64))
    x, index = _routed(3, 4)
    weights = torch.ones_like(index, dtype=x.dtype)
    cases = [((x, index, weights), "were given routing .* take hidden_states \\[E T, H\\] alone"),
             ((x[:-1],), "hidden_states \\(11, 128\\): these 4 experts take \\[E T, 128\\]"),
             ((x[:, :64],), "hidden_states \\(12, 64\\)"),
             ((x.view(4, 3, 128),), "hidden_states \\(4, 3, 128\\)")]
    for args, match in cases:
        with pytest.raises(InvalidProblem, match=match):
            sparse(*args)
    from test_experts_grouped import _mixtral_experts

    top_k = Sparse24Experts.from_experts(_mixtral_experts(torch.float64))
    with pytest.raises(InvalidProblem, match="top_k_index None and top_k_weights None: they take hidden_states "
                                             "\\[T, H\\] with top_k_index"):
        top_k(torch.randn(4, 128, dtype=torch.float64))


def test_calibration_reads_each_expert_s_rows_that_its_router_chose(seed):
    """Each expert's statistics gather the rows of its block that are not zero: the tokens that chose it.  An expert
    no token chose (its block all zero) is reported unreached, and pruned by magnitude."""
    from kernelplan.pruning import experts as calib

    dense = _experts(torch.float64)
    x, index = _routed(40, 4, top_k=2, skip=(1,))
    gatherer = calib._Gatherer(dense, range(4), True, torch.float64)
    calib._gather(lambda: dense(x), dense, gatherer)
    for e in range(4):
        chose = (index == e).any(dim=1)
        assert gatherer.first[e].tokens == int(chose.sum())
        rows = x.view(4, 40, 128)[e][chose]
        torch.testing.assert_close(gatherer.first[e].gram, rows.t() @ rows, rtol=1e-12, atol=1e-12)
    assert gatherer.first[1].tokens == 0
    pruned, unreached, _ = calib.calibrate_experts(dense, "wanda", lambda: dense(x), False, 128, 0.01)
    assert unreached == [1]
    assert [len(v) for v in pruned.values()] == [4, 4]


def _llama4_model(dtype=torch.float64, vocab: int = 128, top_k: int = 1) -> torch.nn.Module:
    """A tiny Llama-4 (text), both layers MoE, its experts' weights random (the class leaves them zero)."""
    config = transformers.Llama4TextConfig(hidden_size=128, intermediate_size=192, intermediate_size_mlp=256,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=32, vocab_size=vocab, num_local_experts=4,
                                           num_experts_per_tok=top_k, interleave_moe_layer_step=1)
    model = transformers.Llama4ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, llama4.Llama4TextExperts):
                module.gate_up_proj.normal_(0, 0.1)
                module.down_proj.normal_(0, 0.1)
    return model


def test_a_sparsified_llama4_calibrates_its_experts_and_compiles_in_one_graph(seed):
    """kp.sparsify with Wanda on a tiny Llama-4: the experts held 2:4, calibrated; the model against its pruned
    dense twin; the experts module compiled fullgraph (the per-expert path) against eager."""
    from helpers import compiled_graphs

    dense = _llama4_model()
    model = copy.deepcopy(dense)
    report = kp.sparsify(model, progress=False, method="wanda", calibration=torch.randint(0, 128, (4, 16)),
                         experts="all")
    names = [f"model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert set(names) <= set(report.converted)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        _routed_close(model(ids).logits, _dense_twin(model, dense)(ids).logits)
    experts = model.get_submodule(names[0])
    x, _ = _routed(5, 4)
    with torch.no_grad():
        got, graphs = compiled_graphs(experts, x)
        torch.testing.assert_close(got, experts(x), rtol=0, atol=0)
    assert len(graphs) == 1


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_sparsified_llama4_s_moe_layers_run_each_token_on_its_chosen_experts(seed, top_k):
    """``fuse_siblings`` routes each Llama4TextMoe (nn/moe_routes.py): each token's scaled copies go to the experts
    its router chose alone.  The model equals its pruned dense twin, which runs every expert on every token (float64,
    the router's float32 scores aside: _routed_close), and so do one MoE layer's output and x's gradient through it.
    After the first call's check (against the layer's own forward), the experts run no every-token call."""
    from kernelplan.nn.routes import route_of

    dense = _llama4_model(top_k=top_k)
    model = copy.deepcopy(dense)
    kp.sparsify(model, progress=False, experts="all")
    twin = _dense_twin(model, dense)
    moes = [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"]
    routes = [route_of(m) for m in moes]
    assert len(routes) == 2 and all(type(r).__name__ == "RoutedMoe" for r in routes)
    every = []
    for moe in moes:
        moe.experts.register_forward_pre_hook(lambda m, args: every.append(args[0].shape))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        want = twin(ids).logits
        _routed_close(model(ids).logits, want)
        assert every == [torch.Size([4 * 18, 128])] * 2  # each layer's check: its own forward, every expert's rows
        every.clear()
        _routed_close(model(ids).logits, want)
    assert not every and all(r.stats == {"fused": 2, "own": 0} and r.checked for r in routes)
    x = torch.randn(3, 5, 128, dtype=torch.float64, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    got, want = moes[1](x), twin.model.layers[1].feed_forward(x_twin)
    _routed_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the router's logits
    got[0].square().sum().backward()
    want[0].square().sum().backward()
    _routed_close(x.grad, x_twin.grad)
    assert not every and routes[1].stats["fused"] == 3


def test_the_moe_route_calls_a_router_that_something_wraps_and_skips_another_router_class(seed):
    """The route reads the router's weight itself: where a hook or an instance forward wraps the router's calls
    (accelerate's offloading), the layer runs its own forward (the router called) until they are gone.  A layer whose
    router is not Llama4Router is not routed."""
    from kernelplan.nn.moe_routes import route_every_token_moes
    from kernelplan.nn.routes import route_of

    model = _llama4_model()
    kp.sparsify(model, progress=False, experts="all")
    moe = model.model.layers[0].feed_forward
    route = route_of(moe)
    x = torch.randn(2, 3, 128, dtype=torch.float64)
    calls = []
    with torch.no_grad():
        want = type(moe).forward(moe, x)[0]
        for wrap in ("hook", "forward"):
            if wrap == "hook":
                handle = moe.router.register_forward_hook(lambda m, args, out: calls.append(m))
            else:
                router = moe.router
                router.forward = lambda h: calls.append(router) or type(router).forward(router, h)
            _routed_close(moe(x)[0], want)
            assert len(calls) == 1 and route.stats["fused"] == 0
            handle.remove() if wrap == "hook" else moe.router.__dict__.pop("forward")
            calls.clear()
        _routed_close(moe(x)[0], want)
    assert not calls and route.stats == {"fused": 1, "own": 2} and route.checked

    other = _llama4_model()
    kp.sparsify(other, progress=False, experts="all")
    for layer in other.model.layers:
        route_of(layer.feed_forward).detach()
        router = layer.feed_forward.router
        layer.feed_forward.router = type("Router", (torch.nn.Linear,), {"forward": type(router).forward})(128, 4)
    assert route_every_token_moes(other) == []


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_token_experts_on_the_grouped_kernel(seed, dtype):
    """One grouped launch a projection, offsets 0, T, 2T ...: against the fp64 oracle (within 2x the error of the
    dense module in the same dtype), from a decode's T to a prefill's, odd T included; replayed in a CUDA graph on
    new inputs; compiled fullgraph (the launches as ops)."""
    dense = _experts(torch.float64, experts=6, hidden=256, inner=320)
    sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).to(dtype)).cuda()
    oracle = _oracle(dense, sparse)
    baseline = copy.deepcopy(oracle).to(dtype).cuda()
    assert sparse.runs_grouped(torch.device("cuda", torch.cuda.current_device()), dtype)
    compiled = torch.compile(sparse, fullgraph=True)
    with torch.no_grad():
        for tokens in (1, 5, 64, 301, 1024):
            x, _ = _routed(tokens, 6, hidden=256, top_k=2)
            want = oracle(x).cuda()
            xd = x.to(dtype).cuda()
            got = sparse(xd)
            assert_close(got, want, baseline(xd), atol=FWD_ATOL[dtype])
            torch.testing.assert_close(compiled(xd), got, rtol=0, atol=0)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sparse(xd)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            captured = sparse(xd)
        xd.copy_(_routed(1024, 6, hidden=256, top_k=2)[0].to(dtype))
        graph.replay()
        torch.testing.assert_close(captured, sparse(xd), rtol=0, atol=0)


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_calls_weighing_the_inputs_on_the_grouped_kernel(seed, dtype):
    """The routing kernel scaling each row it copies by the sigmoid of its top logit (Llama-4's MoE route), then the
    grouped launches: against the fp64 oracle run on every expert's copies, within 2x the error of the dense module
    in the same dtype on Llama-4's own product; top 1 and 2, from a decode's token to a prefill's whose counts the
    scan launch sums."""
    from kernelplan.kernels import moe_route

    dense = _experts(torch.float64, experts=6, hidden=256, inner=320)
    sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).to(dtype)).cuda()
    oracle = _oracle(dense, sparse)
    baseline = copy.deepcopy(oracle).to(dtype).cuda()
    assert 2048 // moe_route._B >= moe_route._SCAN_MIN_CHUNKS
    with torch.no_grad():
        for tokens in (0, 1, 5, 301, 2048):
            for top_k in (1, 2):
                hidden = torch.randn(tokens, 256, device="cuda").to(dtype)
                top, index = torch.topk(torch.randn(tokens, 6, device="cuda").to(dtype), top_k, dim=1)
                scores = torch.zeros(tokens, 6, device="cuda", dtype=dtype).scatter_(
                    1, index, torch.sigmoid(top.float()).to(dtype))  # Llama4Router's, zero where not chosen
                copies = hidden.repeat(6, 1) * scores.t().reshape(-1, 1)  # Llama4TextMoe's product, in dtype
                want = oracle(copies.double().cpu()).view(6, tokens, 256).sum(0)
                base = baseline(copies).view(6, tokens, 256).sum(0)
                got = sparse.routed(hidden, index, top, weigh="sigmoid inputs")
                if not tokens:  # no launch: an empty output
                    assert got.shape == (0, 256) and got.dtype == dtype
                    continue
                assert_close(got, want.cuda(), base, atol=FWD_ATOL[dtype], what=f"{tokens} tokens, top {top_k}")


@gpu
@sm90
def test_a_llama4_sparsified_on_the_gpu_holds_its_experts_at_0_5625x_and_runs(seed, monkeypatch, tmp_path):
    """Sparsified on the GPU ("auto": the grouped kernel runs these experts), each expert in the device layout
    alone; after ``kp.warmup`` (both projections' grouped tiles, no scattered store: no routing), forwards compile
    nothing."""
    from kernelplan.kernels import nvrtc
    from kernelplan.kernels.moe_route import _ROUTE
    from kernelplan.kernels.sparse24_grouped import GROUPED_ROWS
    from kernelplan.nn.routes import route_of

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    config = transformers.Llama4TextConfig(hidden_size=256, intermediate_size=512, intermediate_size_mlp=512,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, vocab_size=256, num_local_experts=8, num_experts_per_tok=1,
                                           interleave_moe_layer_step=1)
    model = transformers.Llama4ForCausalLM(config).to(torch.bfloat16).cuda().eval()
    report = kp.sparsify(model, progress=False)  # "auto": the grouped kernel runs these experts
    experts = [m for m in model.modules() if isinstance(m, Sparse24Experts)]
    assert len(experts) == 2 and all(m.every_token for m in experts)
    held = sum(t.numel() * t.element_size() for m in experts for t in (*m._span(m.first)[:2], *m._span(m.down)[:2]))
    dense = 2 * 8 * (2 * 512 * 256 + 256 * 512) * 2  # layers x experts x (gate_up + down) x bf16 bytes
    assert held * 16 == 9 * dense
    assert all(not name.endswith("experts") for name in report.skipped)
    rows = kp.warmup(model, batch_sizes=(1, 16, 51), progress=False)  # the linear layers' tiles are by rows
    grouped = [r for r in rows if r["backend"] == "grouped"]
    assert sorted((r["m"], r["k"], r["n"]) for r in grouped) == sorted(
        (m, k, n) for m, k in ((1024, 256), (256, 512), (256, 512)) for n in GROUPED_ROWS)
    # The down projection's twice: its every-token launch, and the routed calls' scattered store (nn/moe_routes.py).
    assert sum("scattered" in r["config"] for r in grouped) == len(GROUPED_ROWS)
    built = []  # the defines of each kernel compiled after warmup: what the failure names
    routing = dict(_ROUTE._compiled)  # the routing kernels (Triton's): warmed for the routes' weighing
    compile_ = nvrtc._compile
    monkeypatch.setattr(nvrtc, "_compile", lambda lib, source, arch: built.append(
        [line for line in source.splitlines() if line.startswith("#define")]) or compile_(lib, source, arch))
    with torch.inference_mode():
        for tokens in (1, 16):
            model(torch.randint(0, 256, (1, tokens), device="cuda"))
        logits = model(torch.randint(0, 256, (3, 17), device="cuda")).logits
    assert not built, built
    assert _ROUTE._compiled == routing
    routes = [route_of(m) for m in model.modules() if route_of(m) is not None]
    assert len(routes) == 2 and all(r.stats["fused"] == 3 for r in routes)  # the routed calls ran, warmed
    assert logits.shape == (3, 17, 256) and torch.isfinite(logits).all()
