"""``kp.sparsify`` over model families whose modelling code takes paths the families of ``test_compile_models.py`` do
not: routers that are ``nn.Linear`` subclasses (Phi-MoE, Llama-4), shared experts and multi-head latent attention
(DeepSeek-V3, Qwen2-MoE, GLM-4-MoE), biased experts with their own gating (gpt-oss), hybrid Mamba and
linear-attention layers (Jamba, Bamba, Falcon-H1, Qwen3-Next, LFM2), Mamba-1 mixers that read their projections'
weights directly (Mamba, Falcon-Mamba), weights scaled in place (RWKV), an encoder (ModernBERT) and an audio
encoder-decoder (Whisper).  Each from its transformers class at tiny sizes, float64, its experts 2:4 too: two eager
passes (the first settles the sibling groups) against the dense model holding the pruned weights, and the model
``kp.hf.save_model`` wrote before them, loaded by ``load_model`` (docs/design/0077, 0079)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import kernelplan as kp
from kernelplan.nn import Sparse24Experts
from test_experts import _dense_twin

transformers = pytest.importorskip("transformers")

_D = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=128)
_MOE = dict(num_experts_per_tok=2)
FAMILIES = {  # model type -> its config's keywords (the families' own names for their sizes)
    "phimoe": dict(_D, num_local_experts=4, **_MOE),
    "llama4_text": dict(_D, num_local_experts=4, num_experts_per_tok=1, head_dim=32, intermediate_size_mlp=256,
                        interleave_moe_layer_step=2),
    "deepseek_v3": dict(_D, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                        n_group=2, topk_group=1, **_MOE),
    "qwen2_moe": dict(_D, moe_intermediate_size=64, num_experts=8, shared_expert_intermediate_size=128, **_MOE),
    "glm4_moe": dict(_D, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                     head_dim=32, pad_token_id=0, **_MOE),
    "gpt_oss": dict(_D, num_local_experts=4, head_dim=32, sliding_window=16, **_MOE),
    "jamba": dict(_D, num_experts=4, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                  attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8, mamba_expand=2, **_MOE),
    "bamba": dict(_D, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, attn_layer_indices=[1]),
    "falcon_h1": dict(_D, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
                      head_dim=32),
    "qwen3_next": dict(_D, moe_intermediate_size=64, num_experts=8, head_dim=32,
                       layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, **_MOE),
    "lfm2": dict(_D, layer_types=["conv", "full_attention"], block_ff_dim=256),
    "rwkv": dict(hidden_size=128, num_hidden_layers=2, vocab_size=128, attention_hidden_size=128,
                 intermediate_size=256, rescale_every=1),  # its eval forward scales layer 1's weights in place
    "mamba": dict(hidden_size=128, num_hidden_layers=2, vocab_size=128, state_size=8, expand=2),
    "falcon_mamba": dict(hidden_size=128, num_hidden_layers=2, vocab_size=128, state_size=8, expand=2),
}
# Layers their parent's code reads the weight of (sparsify's DIRECT_WEIGHT_READS): dense, with the reason.
READ_DIRECTLY = {"mamba": ("x_proj", "dt_proj", "out_proj"), "falcon_mamba": ("x_proj", "dt_proj", "out_proj"),
                 "jamba": ("dt_proj",)}
# Families whose experts are held 2:4 (Llama-4's run every token through every expert: nn/experts.py's EVERY_TOKEN).
MOE = {"phimoe", "llama4_text", "deepseek_v3", "qwen2_moe", "glm4_moe", "gpt_oss", "jamba", "qwen3_next"}


def _config(model_type: str, **kw):
    try:
        config = transformers.AutoConfig.for_model(model_type, **kw)
    except (ValueError, KeyError) as e:  # a transformers without the family
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}: {e}")
    config._experts_implementation = "eager"  # the dense experts' loop: grouped_mm takes no float64
    return config


def _check(model, inputs: dict, tmp_path, experts: bool) -> kp.SparsifyReport:
    dense = model.double().eval()
    sparse = copy.deepcopy(dense)
    report = kp.sparsify(sparse, progress=False, experts="all")
    assert report.converted and (not experts or any(isinstance(m, Sparse24Experts) for m in sparse.modules()))
    twin = _dense_twin(sparse, dense)
    kp.hf.save_model(sparse, tmp_path / "model")  # before any forward: RWKV's scales its weights in place
    loaded = kp.hf.load_model(tmp_path / "model").eval()
    assert type(loaded) is type(sparse)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = twin(**inputs).logits
        for _ in range(2):
            torch.testing.assert_close(sparse(**inputs).logits, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(loaded(**inputs).logits, want, rtol=1e-10, atol=1e-10)
    # No op of the model's own code read a 2:4 layer's weight (each such read is a dense copy: dense_view.py).
    assert not [w for w in caught if "read a 2:4 layer's weight" in str(w.message)]
    return report


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sparsified_family_computes_its_pruned_dense_twin_and_round_trips(family, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **FAMILIES[family]))
    report = _check(model, {"input_ids": torch.randint(0, 128, (2, 9))}, tmp_path, family in MOE)
    routers = {name: why for name, why in report.skipped.items() if name.endswith("router")}
    if family in ("phimoe", "llama4_text"):  # nn.Linear subclasses returning their top-k stay dense
        assert routers and all("forward of its own" in why for why in routers.values())
    read = sorted(name for name, why in report.skipped.items() if "reads its weight directly" in why)
    assert {name.rpartition(".")[2] for name in read} == set(READ_DIRECTLY.get(family, ()))
    if family == "llama4_text":
        assert "model.layers.1.feed_forward.experts" not in report.skipped


def test_a_sparsified_modernbert_and_whisper_compute_their_pruned_dense_twins_and_round_trip(tmp_path):
    torch.manual_seed(0)
    bert = _config("modernbert", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    _check(transformers.AutoModelForMaskedLM.from_config(bert), {"input_ids": torch.randint(3, 128, (2, 9))},
           tmp_path / "bert", False)
    whisper = _config("whisper", d_model=128, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, vocab_size=128,
                      num_mel_bins=16, max_source_positions=32, max_target_positions=32, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    _check(transformers.WhisperForConditionalGeneration(whisper),
           {"input_features": torch.randn(2, 16, 64, dtype=torch.float64),
            "decoder_input_ids": torch.randint(0, 128, (2, 5))}, tmp_path / "whisper", False)


def test_a_sparsified_siglip_tower_holds_fc2_padded_and_keeps_the_pooling_heads_out_proj_dense(tmp_path):
    """SigLIP's vision tower, as Gemma-3's, PaliGemma's and LLaVA-OneVision's: its MLP's fc2 has K = 344 here (4304 in
    so400m), not a multiple of 64, and is held padded (0083); the pooling head's nn.MultiheadAttention multiplies by
    its out_proj's weight itself (F.multi_head_attention_forward), so that layer stays dense, with the reason, and
    no op reads a 2:4 layer's weight.  The tower computes its pruned dense twin and round-trips."""
    torch.manual_seed(0)
    config = _config("siglip_vision_model", hidden_size=128, intermediate_size=344, num_attention_heads=4,
                     num_hidden_layers=2, image_size=56, patch_size=14)
    dense = transformers.SiglipVisionModel(config).double().eval()
    sparse = copy.deepcopy(dense)
    report = kp.sparsify(sparse, progress=False)
    assert "reads its weight directly" in report.skipped["head.attention.out_proj"]
    fc2 = sorted(name for name in report.converted if name.endswith("fc2"))
    assert len(fc2) == 3 and sorted(report.padded) == fc2  # two layers' and the head's MLP
    assert all(sparse.get_submodule(name).in_features == 344 for name in fc2)
    twin = _dense_twin(sparse, dense)
    kp.hf.save_model(sparse, tmp_path / "model")
    loaded = kp.hf.load_model(tmp_path / "model").eval()
    pixels = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = twin(pixel_values=pixels).pooler_output
        torch.testing.assert_close(sparse(pixel_values=pixels).pooler_output, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(loaded(pixel_values=pixels).pooler_output, want, rtol=1e-10, atol=1e-10)
    assert not [w for w in caught if "read a 2:4 layer's weight" in str(w.message)]


def test_a_llama_whose_every_k_is_off_the_layouts_step_computes_its_twin_and_round_trips(tmp_path):
    """Hidden 208 and intermediate 352 (multiples of 16, not of 64): every layer is held padded (0083), q/k/v and
    gate/up in sibling groups and gated pairs over the padded K; eager, loaded and compiled against the pruned twin.
    Hidden 200 (rows off the 16-row tile): those layers stay public, their GPU copy named in the report."""
    torch.manual_seed(0)
    ids = {"input_ids": torch.randint(0, 128, (2, 9))}
    config = _config("llama", hidden_size=208, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=128)
    report = _check(transformers.AutoModelForCausalLM.from_config(config), ids, tmp_path / "208", False)
    assert len(report.padded) == len(report.converted) == 14 and not report.derived_on_gpu  # 7 projections a layer
    config = _config("llama", hidden_size=200, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
    report = _check(transformers.AutoModelForCausalLM.from_config(config), ids, tmp_path / "200", False)
    assert sorted(report.padded) == [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj")]
    assert len(report.derived_on_gpu) == 10  # q, k, v, o and down: 200 and 100 rows
