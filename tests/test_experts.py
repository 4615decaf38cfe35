"""MoE experts stored as 3-D weights (transformers 5's experts modules) held 2:4: ``Sparse24Experts``, ``sparsify``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kernelplan as kp
from kernelplan.errors import InvalidProblem
from kernelplan.nn import Sparse24Experts, Sparse24Linear, siblings_of

from helpers import FWD_ATOL, assert_close

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")
gpu = pytest.mark.gpu


def _mixtral(dtype, device="cpu", experts=4, top_k=2):
    """A small Mixtral.  ``top_k=experts`` routes every token to every expert: no top-k choice a low precision can
    flip, for comparisons of a bf16 run with a float64 one."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    cfg._experts_implementation = "eager"  # the reference loop, in every dtype (grouped_mm refuses float64)
    return MixtralForCausalLM(cfg).eval().to(device=device, dtype=dtype)


def _dense_twin(sparse_model, dense_model):
    """``dense_model`` with every 2:4 layer's weight as ``sparse_model`` holds it, decompressed: the same function."""
    twin = copy.deepcopy(dense_model)
    with torch.no_grad():
        for name, mod in sparse_model.named_modules():
            if isinstance(mod, Sparse24Experts):
                dense = twin.get_submodule(name)
                first = "gate_up_proj" if mod.has_gate else "up_proj"  # the source's flags, as it held them
                for e in range(mod.num_experts):
                    for part, layer in ((first, mod.first[e]), ("down_proj", mod.down[e])):
                        w = layer.to_dense().to(getattr(dense, part))  # from any device and dtype
                        getattr(dense, part)[e] = w.t() if mod.is_transposed else w
            elif isinstance(mod, Sparse24Linear) and ".first." not in name and ".down." not in name:
                twin.get_submodule(name).weight.copy_(mod.to_dense())  # copy_ converts device and dtype
    return twin


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_mixtral_experts_are_held_2_4_and_compute_the_pruned_model(seed, dtype):
    """In float64 the whole model against its dense twin; in bf16 (where a rounding can flip a router's choice,
    and with it a token's experts) the report and the layout here, the numbers in the test after."""
    dense = _mixtral(torch.float64)
    model = copy.deepcopy(dense).to(dtype)
    report = kp.sparsify(model, progress=False, experts="all")
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert set(experts) <= set(report.converted)
    for name in experts:
        mod = model.get_submodule(name)
        assert isinstance(mod, Sparse24Experts) and mod.num_experts == 4
        assert all(m.layout == "sp tiled" for m in [*mod.first, *mod.down])
        w = mod.first[1].to_dense().reshape(-1, 4)
        assert ((w != 0).sum(dim=1) <= 2).all()  # each expert pruned 2:4 along its inputs
    # 2 layers x 4 experts x (384 x 128 + 128 x 192) weights, and the attention's 4 projections a layer.
    expert_bytes = 2 * 4 * (384 * 128 + 128 * 192) * torch.finfo(dtype).bits // 8
    attention_bytes = 2 * (128 * 128 * 2 + 64 * 128 * 2) * torch.finfo(dtype).bits // 8
    assert report.bytes_before == expert_bytes + attention_bytes
    if dtype == torch.bfloat16:  # the device layout: half the values, and 4 bits of metadata per 4 of them
        assert report.bytes_after * 16 == report.bytes_before * 9

    if dtype == torch.float64:
        ids = torch.randint(0, 256, (3, 11))
        oracle = _dense_twin(model, dense)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, oracle(ids).logits, rtol=1e-12, atol=1e-12)


def _experts_against_the_oracle(device, tokens, grad=False):
    """One Mixtral experts module, bf16, on fixed routing (some experts get no rows, some odd counts) against the
    fp64 dense module of the same pruned weights; the baseline is that dense module in bf16."""
    dense = _mixtral(torch.float64, experts=8).model.layers[0].mlp.experts
    sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).bfloat16()).to(device)
    oracle = copy.deepcopy(dense)
    with torch.no_grad():
        for e in range(8):
            oracle.gate_up_proj[e] = sparse.first[e].to_dense().double()
            oracle.down_proj[e] = sparse.down[e].to_dense().double()
    baseline = copy.deepcopy(oracle).bfloat16().to(device)
    index, weights = _routing(tokens, 6)  # experts 6 and 7 get nothing
    x = torch.randn(tokens, 2, 128, dtype=torch.float64)[:, 0]  # not contiguous
    with torch.no_grad():
        want = oracle(x, index, weights.double())
        x, index, weights = x.bfloat16().to(device), index.to(device), weights.bfloat16().to(device)
        base = baseline(x, index, weights)
    with torch.set_grad_enabled(grad):  # with autograd, each expert through its own layers
        assert sparse._grouped(x) == (not grad and torch.device(device).type == "cuda" and
                                      torch.cuda.get_device_capability() == (9, 0))
        out = sparse(x, index, weights)
    assert_close(out, want.to(device), base, atol=FWD_ATOL[torch.bfloat16])


def test_bf16_experts_on_fixed_routing(seed):
    _experts_against_the_oracle("cpu", 37)
    _experts_against_the_oracle("cpu", 5, grad=True)


def _gpt_oss_experts(dtype):
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = transformers.GptOssConfig(hidden_size=128, intermediate_size=64, num_local_experts=3, swiglu_limit=3.0)
    cfg._experts_implementation = "eager"
    experts = gpt_oss.GptOssExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def _routing(tokens, experts, k=2):
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]) if tokens else torch.zeros(0, k).long()
    weights = torch.rand(tokens, k).softmax(dim=-1)
    return index, weights


def test_transposed_experts_with_biases_and_their_own_gating(seed):
    """gpt-oss: weights [E, in, out], biases, and a gating that interleaves and clamps (its own _apply_gate)."""
    dense = _gpt_oss_experts(torch.float64)
    if not hasattr(dense, "is_transposed"):  # a transformers whose decorator says nothing of the layout
        with pytest.raises(InvalidProblem, match="without transformers' use_experts_implementation flags"):
            Sparse24Experts.from_experts(dense)
        return
    assert dense.is_transposed and dense.gate_up_proj_bias is not None and "_apply_gate" in vars(type(dense))
    sparse = Sparse24Experts.from_experts(dense)
    assert sparse.first[0].bias is not None and sparse.limit == dense.limit and sparse.alpha == dense.alpha
    wide = torch.randn(9, 256, dtype=torch.float64)
    x = wide[:, ::2]  # not contiguous
    index, weights = _routing(9, 3)
    twin = copy.deepcopy(dense)
    with torch.no_grad():
        for e in range(3):
            twin.gate_up_proj[e] = sparse.first[e].to_dense().t()
            twin.down_proj[e] = sparse.down[e].to_dense().t()
        want = twin(x, index, weights.double())
        out = sparse(x, index, weights.double())
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


class _UpDownExperts(nn.Module):
    """Experts of one activation and no gate (NemotronH's form), under transformers' decorator."""

    def __init__(self, config, experts=3, hidden=128, inner=64):
        super().__init__()
        self.num_experts = experts
        self.up_proj = nn.Parameter(torch.randn(experts, inner, hidden, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner, dtype=torch.float64))
        self.act_fn = nn.GELU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                if e < self.num_experts:
                    h = self.act_fn(self.up_proj[e] @ hidden_states[t])
                    out[t] += top_k_weights[t, j] * (self.down_proj[e] @ h)
        return out


def _up_down():
    try:
        cls = moe.use_experts_implementation(has_gate=False)(type("UpDown", (_UpDownExperts,), {}))
    except TypeError:  # transformers before has_gate
        pytest.skip("this transformers' use_experts_implementation has no has_gate")
    cfg = transformers.PretrainedConfig()
    cfg._experts_implementation = "eager"
    return cls(cfg)


def test_experts_without_a_gate_and_ids_past_the_experts(seed):
    """up_proj alone through the activation; an id past the experts (expert parallelism's sentinel) adds nothing,
    as in transformers' eager loop."""
    dense = _up_down()
    sparse = Sparse24Experts.from_experts(dense)
    assert not sparse.has_gate
    x = torch.randn(7, 128, dtype=torch.float64)
    index, weights = _routing(7, 3)
    index[2, 1] = index[5, 0] = 3  # the sentinel
    twin = copy.deepcopy(dense)
    with torch.no_grad():
        for e in range(3):
            twin.up_proj[e] = sparse.first[e].to_dense()
            twin.down_proj[e] = sparse.down[e].to_dense()
        torch.testing.assert_close(sparse(x, index, weights.double()), twin(x, index, weights.double()),
                                   rtol=1e-12, atol=1e-12)


def test_a_state_dict_loads_into_a_sparsified_model_of_the_same_config(seed):
    model, other = _mixtral(torch.float64), _mixtral(torch.float64)
    kp.sparsify(model, progress=False, experts="all")
    kp.sparsify(other, progress=False, experts="all")
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.first.2.values"].shape == (384, 64)  # the public format
    assert state["model.layers.0.mlp.experts.down.0.metadata"].shape == (128, 24)
    other.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_expert_layers_are_not_sibling_candidates():
    """Each expert reads its own tokens: fuse_siblings would watch them on every call and never group them."""
    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, fuse=True, experts="all")
    experts = model.model.layers[0].mlp.experts
    assert all(siblings_of(m) is None for m in [*experts.first, *experts.down])
    assert siblings_of(model.model.layers[0].self_attn.k_proj) is not None  # the rest of the model still is


def test_three_d_weights_of_an_unknown_module_are_reported(seed):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.Parameter(torch.randn(2, 16, 16))

    model = nn.Module()
    model.odd, model.proj = Odd(), nn.Linear(16, 16)
    report = kp.sparsify(model, progress=False, experts="all")
    assert report.converted == ["proj"]
    why = report.skipped["odd"]
    assert "use_experts_implementation" in why and "3-D weights (stack) stay dense" in why
    assert "experts are" not in why  # such a module may hold no experts (RWKV's time_mix vectors)
    assert isinstance(model.odd.stack, nn.Parameter)


def test_routers_that_are_linear_layers_stay_dense_and_experts_of_2_d_weights_are_reported(seed):
    """DBRX's ``router.layer`` and Hunyuan-MoE's ``gate.wg`` (an output an expert) and Qwen2-MoE's
    ``shared_expert_gate`` (one output) are nn.Linear layers: pruned, they would change which experts tokens reach.
    They stay dense, with the reason; the shared experts' layers beside them (Hunyuan's ``shared_mlp``, Qwen's
    ``shared_expert``) are pruned.  DBRX's experts (``DbrxExpertGLU``: 2-D ``w1``, ``v1``, ``w2``) are reported as
    staying dense, not left out of the report."""
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128)
    configs = {
        "dbrx": (dict(d_model=128, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64,
                      attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                      ffn_config=dict(ffn_hidden_size=256, moe_num_experts=4, moe_top_k=2)),
                 "transformer.blocks.{}.ffn", ["router.layer"], []),
        "hunyuan_v1_moe": (dict(base, moe_intermediate_size=64, num_experts=4, moe_topk=2, head_dim=32),
                           "model.layers.{}.mlp", ["gate.wg"], ["shared_mlp.gate_proj", "shared_mlp.down_proj"]),
        "qwen2_moe": (dict(base, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                           shared_expert_intermediate_size=128),
                      "model.layers.{}.mlp", ["shared_expert_gate"],
                      ["shared_expert.up_proj", "shared_expert.down_proj"]),
    }
    for family, (kw, block, routers, pruned) in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **kw))
        report = kp.sparsify(model, progress=False, experts="all")
        for i in range(2):
            for name in routers:
                full = f"{block.format(i)}.{name}"
                assert type(model.get_submodule(full)) is nn.Linear, full
                assert report.skipped[full].startswith(f"a router of the MoE block {block.format(i)} ("), full
            for name in pruned:
                assert f"{block.format(i)}.{name}" in report.converted, (family, name)
        assert any(n.endswith("self_attn.q_proj") or n.endswith("attn.Wqkv") for n in report.converted), family
        if family == "dbrx":
            why = report.skipped["transformer.blocks.0.ffn.experts.mlp"]
            assert "DbrxExpertGLU holds its experts as 2-D weights (w1, v1, w2)" in why
    mlp = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **base))
    kp.sparsify(mlp, progress=False)  # a dense MLP's gate_proj is no router
    assert isinstance(mlp.model.layers[0].mlp.gate_proj, Sparse24Linear)


def test_error_inputs_are_refused_before_anything_runs(seed):
    sparse = Sparse24Experts.from_experts(_up_down())
    x = torch.randn(4, 128, dtype=torch.float64)
    index, weights = _routing(4, 3)
    for args in [(x[None], index, weights), (x, index[:3], weights[:3]), (x, index, weights[:, :1])]:
        with pytest.raises(InvalidProblem, match="hidden_states .* top_k_index .* top_k_weights"):
            sparse(*args)
    with pytest.raises(InvalidProblem, match="Linear that cannot be held 2:4"):
        Sparse24Experts.from_experts(nn.Linear(16, 16))
    odd = _up_down()
    odd.up_proj = nn.Parameter(torch.randn(3, 64, 100, dtype=torch.float64))
    with pytest.raises(InvalidProblem, match="up_proj: in_features=100 is not a multiple of 8"):
        Sparse24Experts.from_experts(odd)


@gpu
def test_experts_on_the_gpu(seed):
    """bf16 on the GPU against the fp64 oracle, at a decode's and a prefill's token counts; then a whole model
    sparsified on the GPU holds each expert in the device layout alone (0.5625x) and runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for tokens in (0, 3, 37, 600):
        for grad in (False, True):
            _experts_against_the_oracle("cuda", tokens, grad)
    model = _mixtral(torch.bfloat16, "cuda", experts=8)
    report = kp.sparsify(model, progress=False)  # "auto": on Hopper the grouped kernel runs even these small experts
    if torch.cuda.get_device_capability() == (9, 0):
        assert "model.layers.0.mlp.experts" in report.converted
        assert report.bytes_after * 16 == report.bytes_before * 9
    else:
        assert "grouped kernel cannot run them here" in report.skipped["model.layers.0.mlp.experts"]
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (4, 33), device="cuda")).logits
    assert logits.shape == (4, 33, 256) and torch.isfinite(logits).all()


def test_save_model_writes_the_experts_as_transformers_holds_them(tmp_path, seed):
    """format="dense" writes each Sparse24Experts back as the 3-D weights of the module it replaced (the pruned
    ones), which a dense model of the config loads strictly; the 2:4 formats have no layout for them and refuse."""
    from safetensors.torch import load_file

    model, dense = _mixtral(torch.float32), _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="all")
    kp.hf.save_model(model, tmp_path / "dense", format="dense")
    state = load_file(str(tmp_path / "dense" / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(state["model.layers.1.mlp.experts.gate_up_proj"], experts.dense_parts()["gate_up_proj"])
    assert state["model.layers.1.mlp.experts.down_proj"].shape == (4, 128, 192)
    assert not [k for k in state if ".first." in k or ".down." in k]
    dense.load_state_dict(state, strict=True)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidProblem, match="model.layers.0.mlp.experts is a Sparse24Experts .* "
                                             "format='kernelplan'"):
        kp.hf.save_model(model, tmp_path / "bitmask", format="sparse-24-bitmask")
    assert not (tmp_path / "bitmask").exists()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_experts_round_trip_through_the_kernelplan_format(tmp_path, seed, dtype):
    """format="kernelplan" writes the experts stacked and 2:4 ([E, M, K/2] values, [E, M, K/8] metadata, the public
    format), no dense copy of them; load_model builds Sparse24Experts from them that compute what the saved model
    does, exactly."""
    from safetensors.torch import load_file

    model = _mixtral(dtype)
    kp.sparsify(model, progress=False, experts="all")
    kp.hf.save_model(model, tmp_path / "kp")
    state = load_file(str(tmp_path / "kp" / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    assert state[f"{prefix}.gate_up_proj.values"].shape == (4, 384, 64)
    assert state[f"{prefix}.down_proj.metadata"].shape == (4, 128, 24)
    assert f"{prefix}.gate_up_proj" not in state and not [k for k in state if ".first." in k]
    saved = model.get_submodule(prefix)
    assert torch.equal(state[f"{prefix}.down_proj.values"][2], saved.down[2].weight24.public().values)
    loaded = kp.hf.load_model(tmp_path / "kp")
    experts = loaded.get_submodule(prefix)
    assert isinstance(experts, Sparse24Experts) and experts.num_experts == 4
    for e in range(4):
        assert torch.equal(experts.first[e].to_dense(), saved.first[e].to_dense())
    index, weights = _routing(13, 4)
    x = torch.randn(13, 128, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, index, weights.to(dtype)), saved(x, index, weights.to(dtype)), rtol=0,
                                   atol=0)
        if dtype == torch.float64:  # the whole model (in bf16 the loaded model's attention may be another kernel)
            ids = torch.randint(0, 256, (2, 9))
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_stacked_experts_that_do_not_fit_the_model_are_refused(tmp_path, seed):
    from safetensors.torch import load_file, save_file

    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="all")
    kp.hf.save_model(model, tmp_path / "kp")
    path = tmp_path / "kp" / "model.safetensors"
    state = load_file(str(path))
    for leaf in ("values", "metadata"):  # three experts of four
        key = f"model.layers.0.mlp.experts.down_proj.{leaf}"
        state[key] = state[key][:3]
    save_file(state, str(path))
    with pytest.raises(InvalidProblem, match=r"experts.down_proj: the checkpoint holds 3 2:4 experts of \[128, 192\] "
                                             r"\(\[out, in\]\), and the model built from config.json has 4 experts"):
        kp.hf.load_model(tmp_path / "kp")
    del state["model.layers.0.mlp.experts.down_proj.values"]
    save_file(state, str(path))
    with pytest.raises(InvalidProblem, match="down_proj has .'metadata'. but not all of"):
        kp.hf.load_model(tmp_path / "kp")


def test_auto_holds_experts_2_4_only_where_each_is_large(seed, monkeypatch):
    """One GEMM per expert loses to transformers' grouped GEMM where experts are many and small (0.09x at
    Qwen3-30B-A3B's), so "auto" keeps those dense and says why; "none" keeps every one dense."""
    from kernelplan.nn import experts as experts_module

    model = _mixtral(torch.float32)  # 4 experts of 3 x 128 x 192 floats: 288 KiB each
    report = kp.sparsify(model, progress=False)
    why = report.skipped["model.layers.0.mlp.experts"]
    assert "each of its 4 experts holds 0.3 MiB, under 256 MiB" in why and "experts='all'" in why
    assert "the grouped kernel cannot run them here (the weights are not on a CUDA GPU)" in why
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    monkeypatch.setattr(experts_module, "EXPERTS_MIN_BYTES", 288 << 10)
    model = _mixtral(torch.float32)
    assert "model.layers.1.mlp.experts" in kp.sparsify(model, progress=False).converted
    model = _mixtral(torch.float32)
    assert kp.sparsify(model, progress=False, experts="none").skipped["model.layers.1.mlp.experts"].startswith(
        "experts='none'")
    model = _mixtral(torch.float32)
    with pytest.raises(InvalidProblem, match="experts"):
        kp.sparsify(model, progress=False, experts="some")
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear  # refused before anything was replaced


def test_the_gated_epilogue_and_the_autograd_path_agree(seed):
    """Without autograd, Mixtral's default gating (silu of the first half times the second) runs in the first
    GEMM's epilogue; with it, as the GEMM then the module's gating, which gradients flow through."""
    dense = _mixtral(torch.float64).model.layers[0].mlp.experts
    sparse = Sparse24Experts.from_experts(dense)
    assert sparse._epilogue == "gated_silu_first"
    x = torch.randn(21, 128, dtype=torch.float64, requires_grad=True)
    index, weights = _routing(21, 4)
    with torch.no_grad():
        fused = sparse(x, index, weights.double())
    plain = sparse(x, index, weights.double())
    torch.testing.assert_close(fused, plain.detach(), rtol=1e-12, atol=1e-12)
    plain.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and sparse.first[0].values.grad is not None


def test_each_projection_is_held_once_end_to_end(seed):
    """The grouped kernel reads a projection's experts as one tall weight: their tensors are views of one storage,
    laid out again where a deep copy gave them storages of their own; the state_dict stays per expert."""
    sparse = Sparse24Experts.from_experts(_mixtral(torch.bfloat16).model.layers[0].mlp.experts)
    for layers in (sparse.first, sparse.down):
        values, metadata, bias = sparse._span(layers)
        assert bias is None and values.shape[0] == 4 * layers[0].values.shape[0]
        assert len({m.values.untyped_storage().data_ptr() for m in layers}) == 1
        assert layers[2].metadata.data_ptr() == metadata.data_ptr() + 2 * layers[0].metadata.nbytes
    twin = copy.deepcopy(sparse)
    assert len({m.values.untyped_storage().data_ptr() for m in twin.first}) == 4  # deepcopy: one storage each
    values, _, _ = twin._span(twin.first)
    assert len({m.values.untyped_storage().data_ptr() for m in twin.first}) == 1
    assert torch.equal(values, sparse._span(sparse.first)[0])


@gpu
def test_grouped_experts_with_biases_and_in_a_cuda_graph(seed):
    """gpt-oss's experts (transposed, biased, their own gating) in bf16 on the GPU against the fp64 oracle, the
    expert-parallel sentinel included; then the layer captured in a CUDA graph (the grouped path needs no host
    sync) and replayed on new routing."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 (Hopper) GPU: the grouped kernel")
    dense = _gpt_oss_experts(torch.float64)
    if not hasattr(dense, "is_transposed"):
        pytest.skip("this transformers' gpt-oss experts have no is_transposed")
    sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).bfloat16()).cuda()
    oracle = copy.deepcopy(dense)
    with torch.no_grad():
        for e in range(3):
            oracle.gate_up_proj[e] = sparse.first[e].to_dense().t().double()
            oracle.down_proj[e] = sparse.down[e].to_dense().t().double()
            oracle.gate_up_proj_bias[e] = sparse.first[e].bias.double()
            oracle.down_proj_bias[e] = sparse.down[e].bias.double()
    baseline = copy.deepcopy(oracle).bfloat16().cuda()
    x = torch.randn(300, 128, dtype=torch.float64)
    index, weights = _routing(300, 3)
    with torch.no_grad():
        want = oracle(x, index, weights.double())
        x, index, weights = x.bfloat16().cuda(), index.cuda(), weights.bfloat16().cuda()
        assert sparse._grouped(x)
        out, base = sparse(x, index, weights), baseline(x, index, weights)
        assert_close(out, want.cuda(), base, atol=FWD_ATOL[torch.bfloat16])
        # The sentinel (an id past the experts) adds what a zero weight does: nothing.
        sentinel, zeroed = index.clone(), weights.clone()
        sentinel[7, 1] = 3
        zeroed[7, 1] = 0
        torch.testing.assert_close(sparse(x, sentinel, weights), sparse(x, index, zeroed), rtol=0, atol=0)

        replay_on_new_routing(sparse, x, index, weights, 3)


def replay_on_new_routing(sparse, x, index, weights, experts: int) -> None:
    """``sparse`` captured in a CUDA graph on these inputs, then replayed on new ones written in place (x and the
    routing): the replay equals an eager call (the grouped path needs no host sync)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sparse(x, index, weights)  # warm: compiled and the tensor maps encoded outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = sparse(x, index, weights)
    new_index, new_weights = _routing(x.shape[0], experts)
    x.copy_(torch.randn_like(x))
    index.copy_(new_index)
    weights.copy_(new_weights)
    graph.replay()
    torch.testing.assert_close(captured, sparse(x, index, weights), rtol=0, atol=0)


def test_a_moe_directory_says_why_its_experts_stay_dense(tmp_path, seed):
    """On disk a MoE model's experts are per expert (Mixtral's w1/w2/w3), and transformers stacks them as it loads:
    the tensor-by-tensor directory path cannot match them to the model's stacked weights, and says so; load_model
    refuses its output and names transformers' from_pretrained, which reads it."""
    _mixtral(torch.float32).save_pretrained(tmp_path / "dense")
    report = kp.hf.sparsify_directory(tmp_path / "dense", tmp_path / "out")
    assert "model.layers.0.self_attn.q_proj" in report.converted
    assert "transformers stacks them as it loads" in report.skipped["model.layers.1.mlp.experts"]
    with pytest.raises(InvalidProblem, match=r"transformers stacks them as it loads, which this loader does not: "
                                             r"load it with transformers.AutoModelForCausalLM.from_pretrained"):
        kp.hf.load_model(tmp_path / "out")
    kp.hf.register_quantizer()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, Sparse24Linear)
    assert loaded.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 384, 128)  # stacked by transformers, dense


def test_given_public_experts_are_laid_out_straight_into_one_span(seed, monkeypatch):
    """Where the GPU conversion kernels run, a projection's given (public) experts are converted one by one into one
    storage, with no device layout of their own beside it (0045); the module equals one whose experts were laid out
    one by one and joined.  The kernel's place is taken here by the torch ops' conversion of the same bits."""
    from kernelplan.nn import experts as module
    from kernelplan.nn.experts import expert_weight, parts_of
    from kernelplan.sparse24 import layout
    from kernelplan.sparse24.format import prune_compress

    calls = []

    class TorchOps:
        @staticmethod
        def pack_into(values, metadata, tv, tm):
            calls.append(tv.data_ptr())
            tv.copy_(layout.pack_values(values))
            tm.copy_(layout.pack_metadata(metadata))

    dense = _mixtral(torch.float32).model.layers[0].mlp.experts
    pruned = {part: [prune_compress(expert_weight(dense, part, e)) for e in range(4)] for part in parts_of(dense)}
    joined = Sparse24Experts.from_experts(dense, pruned)
    monkeypatch.setattr(module, "gpu_kernels", lambda t: TorchOps)
    spanned = Sparse24Experts.from_experts(dense, pruned)
    assert len(calls) == 8  # each expert of both projections, converted straight into its rows of the span
    for layers, rows in ((spanned.first, calls[:4]), (spanned.down, calls[4:])):
        assert [layer.values.data_ptr() for layer in layers] == rows
        assert {layer.layout for layer in layers} == {"sp tiled"}
        for part in ("values", "metadata"):
            storages = {getattr(layer, part).untyped_storage().data_ptr() for layer in layers}
            assert len(storages) == 1, part  # one storage a part: the span itself
    state, want = spanned.state_dict(), joined.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert {w.layout for ws in pruned.values() for w in ws} == {"public"}  # the caller's lists as they were
    consumed = {k: list(v) for k, v in pruned.items()}
    Sparse24Experts.from_experts(dense, consumed, consume=True)  # the loaders': each public entry dropped in turn
    assert {w.layout for ws in consumed.values() for w in ws} == {"sp tiled"}
    hidden = torch.randn(6, 128)
    index, weights = _routing(6, 4)
    with torch.no_grad():
        torch.testing.assert_close(spanned(hidden, index, weights), joined(hidden, index, weights), rtol=0, atol=0)


class _TorchCompress:
    """The conversion kernels' ``compress_tiled`` stood in for by the torch ops' conversion of the same bits, into
    the given rows; ``refuse`` holds the call numbers that it refuses (the kernel's None), as for a NaN."""

    def __init__(self, refuse=()):
        self.rows, self.refuse = [], set(refuse)

    def compress_tiled(self, w, prune, out):
        from kernelplan.sparse24.format import compress, prune_compress

        self.rows.append(out[0].data_ptr())
        if len(self.rows) - 1 in self.refuse:
            out[0].fill_(7)  # the kernel writes the rows it reaches before the refusal is read
            return None
        w24 = (prune_compress if prune else compress)(w, packed=True)
        out[0].copy_(w24.values)
        out[1].copy_(w24.metadata)
        return out


def _one_storage(module: Sparse24Experts) -> bool:
    return all(len({getattr(m, part).untyped_storage().data_ptr() for m in layers}) == 1
               for layers in (module.first, module.down) for part in ("values", "metadata"))


@pytest.mark.parametrize("make", ["magnitude", "wanda"])
def test_experts_pruned_where_the_kernels_run_are_written_straight_into_one_span(seed, monkeypatch, make):
    """A GPU sparsify prunes and compresses each expert straight into its rows of the projection's span, by
    magnitude (``from_experts``) or calibrated (``calibrate_experts``): no expert's own device layout is made, and
    the span is held as it is (0046).  A refused expert (the kernel's None) is made by the torch ops in storage of
    its own, and the experts are joined as before.  Every module equals the one made without a span."""
    from kernelplan.nn import experts as module
    from kernelplan.pruning import experts as pe

    dense = _mixtral(torch.float32).model.layers[0].mlp.experts
    index, weights = _routing(24, 4)
    hidden = torch.randn(24, 128)

    def build():
        if make == "magnitude":
            return Sparse24Experts.from_experts(dense)
        pruned, _, _ = pe.calibrate_experts(dense, "wanda", lambda: dense(hidden, index, weights), False, 128, 0.01)
        return Sparse24Experts.from_experts(dense, pruned)

    joined = build()  # on the CPU: each expert in storage of its own, joined by _span
    stand_in = _TorchCompress()
    monkeypatch.setattr(module, "gpu_kernels", lambda t: stand_in)
    spanned = build()
    assert len(stand_in.rows) == 8 and _one_storage(spanned)
    held = [layer.values.data_ptr() for layers in (spanned.first, spanned.down) for layer in layers]
    assert sorted(held) == sorted(stand_in.rows)  # the span itself, held as it was written
    stand_in = _TorchCompress(refuse={5})
    monkeypatch.setattr(module, "gpu_kernels", lambda t: stand_in)
    refused = build()
    assert len(stand_in.rows) == 8 and _one_storage(refused)  # joined again, with the refused expert's own rows
    assert refused.down[1].values.data_ptr() != stand_in.rows[5]
    for got in (spanned, refused):
        for layers in (got.first, got.down):  # what the grouped kernel reads is what each expert holds
            values, metadata, _ = got._span(layers)
            assert torch.equal(values, torch.cat([m.values.detach() for m in layers]))
            assert torch.equal(metadata, torch.cat([m.metadata for m in layers]))
        state, want = got.state_dict(), joined.state_dict()
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
        with torch.no_grad():
            torch.testing.assert_close(got(hidden, index, weights), joined(hidden, index, weights), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_experts_pruned_on_the_gpu_peak_at_what_they_hold(seed, method):
    """On the GPU each expert is pruned and compressed straight into the span the module then holds: building the
    module allocates what it holds, plus at most one expert's weight.  Before 0046 each expert's own device layout
    sat beside the span as it was joined: a whole projection over.  The module equals the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from kernelplan.pruning import experts as pe

    cfg = MixtralConfig(hidden_size=1024, intermediate_size=2048, num_local_experts=8)
    cfg._experts_implementation = "eager"
    dense = MixtralExperts(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_()
    index, weights = _routing(64, 8)
    hidden = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    run = lambda: dense(hidden, index.cuda(), weights.cuda().bfloat16())  # noqa: E731
    pruned = pe.calibrate_experts(dense, method, run, False, 128, 0.01)[0] if method != "magnitude" else None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sparse = Sparse24Experts.from_experts(dense, pruned)
    torch.cuda.synchronize()
    held, peak = torch.cuda.memory_allocated() - start, torch.cuda.max_memory_allocated() - start
    spans = sum(p.numel() for p in dense.parameters()) * 2 * 0.5625  # both projections' experts, 2:4 in bf16
    expert = dense.gate_up_proj[0].numel() * 2 * 0.5625  # the larger projection's one expert: 4.7 MB
    if pruned is not None:  # calibrate_experts made the spans: the module holds them, and allocates next to nothing
        assert held < expert / 8 and peak < expert / 8, (held, peak)
    else:
        assert spans <= held < spans + expert / 8 and peak - held < expert, (held, peak)
    cpu = Sparse24Experts.from_experts(copy.deepcopy(dense).cpu(), None if pruned is None else
                                       {k: [w.to("cpu") for w in v] for k, v in pruned.items()})
    state, want = sparse.state_dict(), cpu.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k].cpu(), want[k]) for k in want)


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_sparsify_frees_each_dense_experts_module_as_it_is_replaced(seed, monkeypatch, method):
    """A layer's dense experts are freed once its 2:4 ones replace them, not when sparsify returns (0046)."""
    from test_pruning import _alive_as_replaced

    alive = _alive_as_replaced(monkeypatch, "_replace_experts")
    model = _mixtral(torch.float32)
    kp.sparsify(model, method=method, calibration=torch.randint(0, 256, (2, 8)) if method != "magnitude" else None,
                experts="all", progress=False)
    assert alive == [0, 0] and isinstance(model.model.layers[1].mlp.experts, Sparse24Experts)


def test_load_model_lays_each_expert_out_as_it_reads_it(tmp_path, seed, monkeypatch):
    """A save_pretrained MoE directory (one layer an expert): where the conversion kernels run, load_model converts
    each expert into its rows of the projection's span as it is read, rather than holding every expert's checkpoint
    tensors until the end (0046); the span is then held as written.  The kernel's place is taken by the torch ops."""
    from kernelplan import hf
    from kernelplan.nn import experts as module
    from kernelplan.nn.experts import ExpertSpan
    from kernelplan.sparse24 import layout

    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="all")
    model.save_pretrained(tmp_path)
    read, packed = [0], []

    class TorchOps:
        @staticmethod
        def pack_into(values, metadata, tv, tm):
            packed.append((read[0], tv.data_ptr()))
            tv.copy_(layout.pack_values(values))
            tm.copy_(layout.pack_metadata(metadata))

    def counted(*args, **kwargs):
        for item in iter_layers(*args, **kwargs):
            read[0] += 1
            yield item

    iter_layers = hf.iter_layers
    monkeypatch.setattr(hf, "iter_layers", counted)
    monkeypatch.setattr(module, "gpu_kernels", lambda t: TorchOps)
    loaded = hf.load_model(tmp_path)
    assert len(packed) == 2 * 2 * 4  # layers x projections x experts, each converted once
    assert [n for n, _ in packed] == sorted(n for n, _ in packed) and packed[0][0] < packed[-1][0] < read[0]
    for i in range(2):
        experts = loaded.model.layers[i].mlp.experts
        held = {layer.values.data_ptr() for layers in (experts.first, experts.down) for layer in layers}
        assert held <= {ptr for _, ptr in packed}  # the rows written as read: no copy made after
    state, want = loaded.state_dict(), model.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    span = ExpertSpan(4, (384, 128), torch.zeros(1))
    span.kernels = TorchOps
    w = loaded.model.layers[0].mlp.experts.first[0].weight24.public()
    assert span.laid_out(4, w) is w and span.laid_out(-1, w) is w and span.parts is None  # no rows: made apart
    elsewhere = kp.sparse24.Sparse24Weight(w.values.to("meta"), w.metadata.to("meta"), _validate=False)
    assert span.laid_out(0, elsewhere) is elsewhere and span.parts is None  # another device's: made apart too


def test_the_dense_module_given_back_runs_its_own_weights_where_the_source_had_accelerate_hooks(seed):
    """A device_map's accelerate hooks replace the experts module's forward with one bound to it; the module
    to_dense_module gives back runs its class's forward on the pruned weights, not the source's dense ones."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = _mixtral(torch.float32)
    hooks.add_hook_to_module(model.model.layers[0].mlp.experts, hooks.ModelHook())
    kp.sparsify(model, progress=False, experts="all")
    sparse = model.model.layers[0].mlp.experts
    dense = sparse.to_dense_module()
    assert "forward" not in vars(dense) and not hasattr(dense, "_hf_hook")
    hidden = torch.randn(5, 128)
    index, weights = _routing(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(dense(hidden, index, weights), sparse(hidden, index, weights), rtol=1e-5,
                                   atol=1e-6)


def _gpt_oss_model():
    """A small gpt-oss in float64: experts of [E, in, out] weights (transposed) with biases, all drawn at random."""
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=3,
                                    num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(cfg).eval().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.3)
    return model


def test_transposed_experts_with_biases_round_trip(tmp_path, seed):
    """gpt-oss's experts ([E, in, out] weights, biases): saved as each expert's [out, in], and loaded back into a
    model whose module holds them transposed."""
    model = _gpt_oss_model()
    kp.sparsify(model, progress=False, experts="all")
    saved = model.model.layers[0].mlp.experts
    assert isinstance(saved, Sparse24Experts) and saved.is_transposed
    kp.hf.save_model(model, tmp_path / "kp")
    loaded = kp.hf.load_model(tmp_path / "kp")
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, Sparse24Experts) and experts.is_transposed
    assert torch.equal(experts.first[1].bias, saved.first[1].bias)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_the_sparsify_command_calibrates_a_moe_directory_and_writes_its_experts_2_4(tmp_path, seed):
    """A dense Mixtral directory (per-expert tensors on disk) through `kernelplan sparsify --calibration`: loaded by
    transformers, every expert calibrated, the experts written stacked 2:4, and load_model reads the result."""
    import numpy as np

    from helpers import kernelplan_cli

    dense = _mixtral(torch.float32)
    dense.save_pretrained(tmp_path / "dense")
    np.save(tmp_path / "calib.npy", torch.randint(0, 256, (4, 24)).numpy())
    done = kernelplan_cli("sparsify", tmp_path / "dense", tmp_path / "out", "--method", "sparsegpt", "--calibration",
                          tmp_path / "calib.npy", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "model.layers.1.mlp.experts.down_proj (mean over experts)" in done.stdout
    loaded = kp.hf.load_model(tmp_path / "out")
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, Sparse24Experts)
    original = dense.model.layers[1].mlp.experts.down_proj[2].detach()
    pruned = experts.down[2].to_dense()
    assert ((pruned.reshape(-1, 4) != 0).sum(-1) <= 2).all() and not torch.equal(pruned, original)


def test_the_sparsify_command_holds_a_moe_directory_s_experts_2_4_without_calibration(tmp_path, seed):
    """Magnitude, no calibration: the shard-by-shard path cannot stack per-expert tensors, so a MoE directory is
    loaded whole and says so; --experts none keeps the streaming path, experts dense."""
    from helpers import kernelplan_cli

    dense = _mixtral(torch.float32)
    dense.save_pretrained(tmp_path / "dense")
    done = kernelplan_cli("sparsify", tmp_path / "dense", tmp_path / "out", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "2 MoE experts modules (model.layers.0.mlp.experts ...): the model is loaded whole" in done.stdout
    assert "or with transformers (AutoModelForCausalLM, or the class config.json names) from_pretrained(DIR) once" \
        in done.stdout
    loaded = kp.hf.load_model(tmp_path / "out")
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts, Sparse24Experts)
    want = Sparse24Experts.from_experts(dense.model.layers[0].mlp.experts)
    assert torch.equal(experts.down[3].to_dense(), want.down[3].to_dense())  # magnitude, as kp.sparsify prunes
    streamed = kernelplan_cli("sparsify", tmp_path / "dense", tmp_path / "streamed", "--experts", "none")
    assert streamed.returncode == 0, streamed.stderr
    assert "loaded whole" not in streamed.stdout and "They are copied dense" in streamed.stdout
