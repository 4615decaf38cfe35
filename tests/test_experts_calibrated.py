"""Wanda and SparseGPT for MoE experts (``pruning/experts.py``): each expert scored on the tokens routed to it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.nn import Sparse24Experts
from kernelplan.pruning import experts as pe
from kernelplan.pruning import methods

from test_experts import _gpt_oss_experts, _mixtral, _routing

transformers = pytest.importorskip("transformers")


def _wanda_reference(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Wanda's mask from its definition, in fp64: |W_ij| ||X_j||_2, the 2 best of each 4 along K kept."""
    score = (w.abs() * x.double().norm(dim=0)).reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, score.topk(2, dim=-1).indices, True)
    return torch.where(keep.reshape(w.shape), w, torch.zeros_like(w))


def _routed(module, hidden, index, e):
    """Expert e's inputs of each projection, written out for Mixtral's experts: the rows routed to it, and those rows
    through silu(x W_gate^T) * (x W_up^T)."""
    x = hidden[(index == e).any(dim=-1)]
    gate, up = module.gate_up_proj[e].chunk(2, dim=0)
    return x, F.silu(x @ gate.T) * (x @ up.T)


def _one_layer(tokens=40, experts=6, unreached=()):
    module = _mixtral(torch.float64, experts=experts).model.layers[0].mlp.experts
    with torch.no_grad():
        for p in module.parameters():  # weights of several scales, so that the scores differ from magnitude's
            p.mul_(torch.rand(p.shape[:-1], dtype=p.dtype)[..., None] * 4)
    reachable = [e for e in range(experts) if e not in unreached]
    index = torch.stack([torch.tensor(reachable)[torch.randperm(len(reachable))[:2]] for _ in range(tokens)])
    hidden = torch.randn(tokens, 2, 128, dtype=torch.float64)[:, 1]  # not contiguous
    hidden[:, 5] *= 30  # an outlier feature, as LLMs grow them: Wanda keeps its weights where magnitude does not
    weights = torch.rand(tokens, 2, dtype=torch.float64).softmax(-1)
    return module, hidden, index, (lambda: module(hidden, index, weights))


@pytest.mark.parametrize("chunk", [None, 1])
def test_wanda_scores_each_expert_on_its_own_tokens(seed, monkeypatch, chunk):
    """Against Wanda written from its definition on each expert's routed rows, for both projections; ``chunk=1``
    gathers one expert per pass (the statistics budget of a large model) and must give the same weights."""
    module, hidden, index, run = _one_layer()
    if chunk is not None:
        monkeypatch.setattr(pe, "STATS_BYTES", 1)
    pruned, unreached, errors = pe.calibrate_experts(module, "wanda", run, False, 128, 0.01)
    assert unreached == [] and errors == {}
    differs = 0
    for e in range(module.gate_up_proj.shape[0]):
        x, h = _routed(module, hidden, index, e)
        for name, inputs in (("gate_up_proj", x), ("down_proj", h)):
            want = _wanda_reference(getattr(module, name)[e].detach(), inputs)
            got = pruned[name][e].decompress()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            differs += int((want != methods.magnitude(getattr(module, name)[e].detach())).any())
    assert differs  # the test would catch magnitude passed off as Wanda


def test_sparsegpt_uses_each_expert_s_gram_matrix(seed):
    module, hidden, index, run = _one_layer()
    pruned, _, errors = pe.calibrate_experts(module, "sparsegpt", run, True, 32, 0.01)
    for e in (0, 3):
        x, h = _routed(module, hidden, index, e)
        for name, inputs in (("gate_up_proj", x), ("down_proj", h)):
            stats = methods.InputStats(inputs.shape[1], inputs.device, True, torch.float64)
            stats.gram += inputs.T @ inputs
            want = methods.sparsegpt(getattr(module, name)[e].detach(), stats, 32, 0.01)
            torch.testing.assert_close(pruned[name][e].decompress(), want, rtol=1e-9, atol=1e-12)
    magnitude, _, by_magnitude = pe.calibrate_experts(module, "magnitude", run, True, 32, 0.01)
    for name in ("gate_up_proj", "down_proj"):  # what SparseGPT is for: less output error on its inputs
        assert errors[name] < 0.8 * by_magnitude[name]


def test_an_expert_no_token_reaches_is_pruned_by_magnitude_and_named(seed):
    module, _, _, run = _one_layer(unreached=(2, 4))
    pruned, unreached, _ = pe.calibrate_experts(module, "sparsegpt", run, False, 128, 0.01)
    assert unreached == [2, 4]
    for e in unreached:
        w = module.down_proj[e].detach()
        torch.testing.assert_close(pruned["down_proj"][e].decompress(), methods.magnitude(w), rtol=0, atol=0)


def test_sparsify_calibrates_a_mixtral_s_experts(seed):
    """The whole path: every block's experts replaced, scored on their tokens, the errors and unreached experts in the
    report, and SparseGPT's output error on the experts well under magnitude's."""
    dense = _mixtral(torch.float32, experts=4)
    ids = torch.randint(0, 256, (4, 24))
    reports = {}
    for method in ("magnitude", "sparsegpt"):
        model = copy.deepcopy(dense)
        reports[method] = report = kp.sparsify(model, progress=False, calibration=ids, method=method, report=True,
                                               experts="all")
        for i in range(2):
            assert isinstance(model.model.layers[i].mlp.experts, Sparse24Experts)
            assert f"model.layers.{i}.mlp.experts" in report.converted
        assert "experts" in report.seconds and "pruned by magnitude, no calibration" not in report.summary()
        with torch.no_grad():
            assert torch.isfinite(model(ids[:1]).logits).all()
    for part in ("gate_up_proj", "down_proj"):
        key = f"model.layers.0.mlp.experts.{part} (mean over experts)"
        assert reports["sparsegpt"].errors[key] < 0.8 * reports["magnitude"].errors[key]


def test_sparsify_names_the_experts_calibration_never_reached(seed):
    model = _mixtral(torch.float32, experts=8)

    def route_to_the_first_six(router, args, out):  # (logits, top-k weights, top-k experts), as Mixtral's router
        first = torch.arange(out[0].shape[0]) % 6  # every one of the six gets tokens, 6 and 7 none
        index = torch.stack([first, (first + 1) % 6], dim=-1)
        return out[0], torch.full(index.shape, 0.5, dtype=out[1].dtype), index

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(route_to_the_first_six)
    unrouted = model.model.layers[0].mlp.experts.down_proj[7].detach().clone()
    report = kp.sparsify(model, progress=False, calibration=torch.randint(0, 256, (2, 16)), method="wanda",
                         experts="all")
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert report.uncalibrated == {name: [6, 7] for name in names}
    assert f"no calibration token routed to them: {names[1]} experts 6, 7" in report.summary()
    held = model.get_submodule(names[0]).down[7].to_dense()
    torch.testing.assert_close(held, methods.magnitude(unrouted), rtol=0, atol=0)


def test_gpt_oss_experts_are_calibrated_through_their_own_gating(seed):
    """Transposed weights, biases and gpt-oss's clamped, interleaved gating: the down projection's inputs are what
    the module's own forward computes between its projections (read here by hooking its down matmul's input)."""
    module = _gpt_oss_experts(torch.float64)
    tokens = 30
    index, weights = _routing(tokens, 3)
    hidden = torch.randn(tokens, 128, dtype=torch.float64)
    run = lambda: module(hidden, index, weights.double())  # noqa: E731
    pruned, unreached, _ = pe.calibrate_experts(module, "wanda", run, False, 128, 0.01)
    assert unreached == []
    for e in range(3):
        x = hidden[(index == e).any(dim=-1)]
        gate_up = x @ module.gate_up_proj[e] + module.gate_up_proj_bias[e]
        h = type(module)._apply_gate(module, gate_up)
        for name, inputs in (("gate_up_proj", x), ("down_proj", h)):
            w = getattr(module, name)[e].detach().T
            torch.testing.assert_close(pruned[name][e].decompress(), _wanda_reference(w, inputs), rtol=0, atol=0)


@pytest.mark.gpu
def test_experts_calibrate_on_the_gpu_as_on_the_cpu(seed):
    """SparseGPT on a Mixtral layer's experts on the GPU (the routed rows' Gram matrices there) against the same on
    the CPU, in fp32, on the same hidden states and routing: masks and errors agree.  Then a whole model sparsified
    on the GPU runs.  (Whole models compared layer by layer drift apart: layer 1 calibrates on layer 0's pruned
    outputs, and SparseGPT's chained updates turn their last-bit differences into 8% of layer 1's mask, 370eb7f.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    module = _mixtral(torch.float32, experts=4).model.layers[0].mlp.experts
    index, weights = _routing(96, 4)
    hidden = torch.randn(96, 128)
    got = {}
    for device in ("cpu", "cuda"):
        mod, x, i, w = (t.to(device) for t in (copy.deepcopy(module), hidden, index, weights))
        got[device] = pe.calibrate_experts(mod, "sparsegpt", lambda: mod(x, i, w), True, 128, 0.01)
    (cpu, cpu_unreached, cpu_errors), (gpu, gpu_unreached, gpu_errors) = got["cpu"], got["cuda"]
    assert cpu_unreached == gpu_unreached == []
    for name in cpu:
        for e in range(4):
            a, b = cpu[name][e].decompress(), gpu[name][e].decompress().cpu()
            agree = float(((a != 0) == (b != 0)).float().mean())
            assert agree > 0.98, f"{name} expert {e}: masks agree on {agree:.3f} only"
        assert gpu_errors[name] == pytest.approx(cpu_errors[name], rel=0.02), name
    model = _mixtral(torch.float32, experts=4).cuda()
    report = kp.sparsify(model, method="sparsegpt", calibration=torch.randint(0, 256, (4, 32)), report=True,
                         progress=False, experts="all")
    assert all(f"model.layers.{i}.mlp.experts" in report.converted for i in range(2))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 256, (2, 16), device="cuda")).logits).all()
