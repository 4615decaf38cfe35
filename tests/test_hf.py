"""Hugging Face model directories in kernelplan's 2:4 format, compressed-tensors' sparse-24-bitmask and dense 2:4."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import kernelplan as kp
from kernelplan import hf
from kernelplan.errors import InvalidProblem
from kernelplan.sparse24.format import compress, prune
from helpers import kernelplan_cli

transformers = pytest.importorskip("transformers")
try:
    from compressed_tensors.compressors.sparse_compressors.sparse_24_bitmask import Sparse24BitMaskCompressor
    from compressed_tensors.config import SparsityCompressionConfig
except ImportError:  # the last release with the 2:4 compressor pins transformers<5: install it with --no-deps
    Sparse24BitMaskCompressor = None


def _llama(tie: bool = True):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("fmt", hf.FORMATS)
def test_a_sparsified_model_round_trips_through_a_sharded_directory(tmp_path, seed, fmt):
    model = _llama()
    kp.sparsify(model, progress=False)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ref = model(ids).logits
    files = hf.save_model(model, tmp_path, fmt, max_shard_bytes=60_000)
    assert hf.INDEX in files and sum(f.endswith(".safetensors") for f in files) > 2
    assert hf.checkpoint_format(hf.read_config(tmp_path)) == fmt
    loaded = hf.load_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in loaded.modules()) == 14
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("build", ["llama", "gpt2"])
def test_a_sparsified_models_own_save_pretrained_writes_a_directory_load_model_reads(tmp_path, seed, build):
    """The HF-native save: config.json records kernelplan's format, which the model's 2:4 state_dict is in."""
    model = _llama() if build == "llama" else _gpt2()
    ids = torch.randint(0, 96, (2, 12))
    kp.sparsify(model, progress=False, method="wanda", calibration=torch.randint(0, 96, (4, 16)))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == {
        "quant_method": "kernelplan", "format": "kernelplan.sparse24", "format_version": kp.sparse24.FORMAT_VERSION}
    assert hf.layer_shapes(tmp_path)[0] == "2:4"
    loaded = hf.load_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in loaded.modules()) == (14 if build == "llama" else 8)
    # What load_model builds is marked too, so it saves again the same way.
    loaded.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(hf.load_model(tmp_path / "again")(ids).logits, ref)


def test_a_model_loaded_from_a_bitmask_checkpoint_drops_its_sparsity_record(tmp_path, seed):
    """Loaded, its 2:4 layers' state_dict is kernelplan's format: config.json must no longer say bitmask."""
    model = _llama()
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path / "bitmask", "sparse-24-bitmask")
    loaded = hf.load_model(tmp_path / "bitmask")
    assert loaded.config.quantization_config == {"quant_method": "kernelplan", "format": "kernelplan.sparse24",
                                                 "format_version": kp.sparse24.FORMAT_VERSION}
    loaded.save_pretrained(tmp_path / "saved")
    config = hf.read_config(tmp_path / "saved")
    assert "sparsity_config" not in config["quantization_config"] and hf.checkpoint_format(config) == "kernelplan"
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(hf.load_model(tmp_path / "saved")(ids).logits, model(ids).logits)


def test_2_4_layers_made_by_hand_and_saved_unmarked_are_refused_with_the_two_fixes(tmp_path, seed):
    model = _llama()
    model.model.layers[0].mlp.down_proj = kp.nn.Sparse24Linear.from_dense(model.model.layers[0].mlp.down_proj)
    model.save_pretrained(tmp_path / "unmarked")
    with pytest.raises(InvalidProblem, match=r"config.json does not say so .* kp.hf.mark_config\(model\)"):
        hf.load_model(tmp_path / "unmarked")
    hf.mark_config(model)
    model.save_pretrained(tmp_path / "marked")
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        assert torch.equal(hf.load_model(tmp_path / "marked")(ids).logits, model(ids).logits)


def test_sparsify_marks_the_config_only_of_a_model_it_changed(seed):
    model = _llama()
    kp.sparsify(model, progress=False, filter_fn=lambda name, layer: False)
    assert not hasattr(model.config, "quantization_config")
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32))
    kp.sparsify(plain, progress=False)  # no transformers config: nothing to record, nothing raised
    assert isinstance(plain[0], kp.nn.Sparse24Linear) and not hasattr(plain, "config")


@pytest.mark.parametrize("version, match", [(2, "newer than this kernelplan's 1: upgrade"),
                                            ("1", "positive integer"), (0, "positive integer"),
                                            (True, "positive integer")])
def test_a_kernelplan_directory_of_another_format_version_is_refused(tmp_path, seed, version, match):
    model = _llama()
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["format_version"] = version
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidProblem, match=match):
        hf.load_model(tmp_path)


def test_a_moe_models_dense_experts_by_save_pretrained_are_refused_naming_from_pretrained(tmp_path, seed):
    """save_pretrained writes a MoE model's dense experts per expert (Mixtral's w1/w2/w3, transformers' conversion
    reversed); load_model does not stack them, and names the loader that does, which then reads the directory."""
    from test_experts import _mixtral

    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="none")  # the attention layers 2:4, the experts dense
    model.save_pretrained(tmp_path)
    with pytest.raises(InvalidProblem, match=r"dense experts are stored per expert.*from_pretrained\(path\) after "
                                             r"kp.hf.register_quantizer\(\)"):
        hf.load_model(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, kp.nn.Sparse24Linear)
    saved, read = model.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys() and all(torch.equal(saved[k], read[k]) for k in saved)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():  # loaded, the experts run transformers' default grouped_mm, not the eager loop _mixtral sets
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


def test_bitmask_conversion_is_numpys_little_endian_packbits(seed):
    w = prune(torch.randn(24, 96))  # no kept weight is zero: the mask is w != 0
    w24 = compress(w)
    bitmask = hf.metadata_to_bitmask(w24.metadata)
    expected = np.packbits((w != 0).numpy(), axis=-1, bitorder="little")
    assert bitmask.dtype == torch.uint8 and np.array_equal(bitmask.numpy(), expected)
    assert torch.equal(hf.bitmask_to_metadata(bitmask, tuple(w.shape)), w24.metadata)
    bad = bitmask.clone()
    bad[3, 2] |= 0xFF
    with pytest.raises(InvalidProblem, match="row 3, group 4 keeps 4 of 4"):
        hf.bitmask_to_metadata(bad, tuple(w.shape))
    with pytest.raises(InvalidProblem, match="uint8"):
        hf.bitmask_to_metadata(bitmask.to(torch.int16), tuple(w.shape))


def test_dense_two_four_checkpoints_are_detected_and_a_layer_that_is_not_is_refused(tmp_path, seed):
    model = _llama()
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path, "dense")
    loaded = hf.load_model(tmp_path)
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in loaded.modules()) == 14
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][0, :4] = 1.0  # 4 non-zeros in one group
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(InvalidProblem, match="model.layers.1.mlp.up_proj.weight is not 2:4"):
        hf.load_model(tmp_path)


def test_directory_errors_name_the_problem(tmp_path):
    with pytest.raises(InvalidProblem, match="no config.json"):
        hf.load_model(tmp_path)
    model = _llama()
    hf.save_model(model, tmp_path, "kernelplan", max_shard_bytes=60_000)
    os.remove(next(tmp_path.glob("model-00002-*.safetensors")))
    with pytest.raises(InvalidProblem, match="missing; the download is incomplete"):
        list(hf.iter_tensors(tmp_path))
    with pytest.raises(InvalidProblem, match="format"):
        hf.save_model(model, tmp_path, "marlin-24")


@pytest.mark.skipif(Sparse24BitMaskCompressor is None, reason="compressed-tensors 0.14.0 is not installed "
                    "(pip install --no-deps compressed-tensors==0.14.0 loguru psutil)")
def test_compressed_tensors_0_14_reads_ours_and_we_read_theirs(tmp_path, seed):
    from safetensors.torch import save_file

    config = SparsityCompressionConfig.load_from_registry("sparse-24-bitmask", targets=["Linear"], ignore=["lm_head"],
                                                          sparsity_structure="2:4", global_sparsity=0.5)
    compressor = Sparse24BitMaskCompressor(config)
    # Theirs -> ours: a pruned model's state dict compressed by compressed-tensors, read by kernelplan.
    model = _llama(tie=False)
    targets = set()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(prune(m.weight))
                targets.add(name)
    state = compressor.compress(model.state_dict(), compression_targets=targets)
    (tmp_path / "theirs").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "theirs" / "model.safetensors")
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"version": "0.14.0", "quant_method": "compressed-tensors",
                                  "sparsity_config": config.model_dump(), "transform_config": {}}
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(cfg))
    loaded = hf.load_model(tmp_path / "theirs")
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in loaded.modules()) == len(targets)
    # Ours -> theirs: kernelplan writes sparse-24-bitmask, compressed-tensors decompresses it.
    kp.sparsify(ours := _llama(tie=False), progress=False)
    hf.save_model(ours, tmp_path / "ours", "sparse-24-bitmask", max_shard_bytes=60_000)
    dense = dict(compressor.decompress(str(tmp_path / "ours")))
    sparse_layers = [n for n, m in ours.named_modules() if isinstance(m, kp.nn.Sparse24Linear)]
    assert len(sparse_layers) == 14
    for name in sparse_layers:
        assert torch.equal(dense[f"{name}.weight"], ours.get_submodule(name).to_dense()), name


def test_the_sparsify_command_prunes_a_model_directory_with_calibration_and_eval(tmp_path, seed):
    model = _llama()
    model.save_pretrained(tmp_path / "dense")
    np.save(tmp_path / "calib.npy", torch.randint(0, 96, (4, 32)).numpy())
    np.save(tmp_path / "eval.npy", torch.randint(0, 96, (200,)).numpy())
    run = lambda *a: kernelplan_cli("sparsify", *a)  # noqa: E731
    done = run(tmp_path / "dense", tmp_path / "out", "--method", "wanda", "--calibration", tmp_path / "calib.npy",
               "--eval", tmp_path / "eval.npy", "--seq-len", "50", "--format", "sparse-24-bitmask", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "dense perplexity:" in done.stdout and "sparse perplexity (wanda):" in done.stdout
    assert "converted 14 layers by wanda" in done.stdout
    assert hf.checkpoint_format(hf.read_config(tmp_path / "out")) == "sparse-24-bitmask"
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in hf.load_model(tmp_path / "out").modules()) == 14
    refused = run(tmp_path / "dense" / "model.safetensors", tmp_path / "x.safetensors", "--method", "sparsegpt")
    assert refused.returncode == 2 and "need a model" in refused.stderr
    bad = run(tmp_path / "dense", tmp_path / "out2", "--calibration", tmp_path / "eval.npy", "--seq-len", "500",
              "--device", "cpu")
    assert bad.returncode == 2 and "fewer than one window" in bad.stderr


@pytest.mark.gpu
def test_a_bitmask_checkpoint_loads_onto_the_gpu_with_no_dense_copy_of_its_2_4_layers(tmp_path, seed):
    model = _llama(tie=False).to(torch.bfloat16)
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path, "sparse-24-bitmask")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = hf.load_model(tmp_path, "cuda")
    held = sum(t.numel() * t.element_size() for t in list(loaded.parameters()) + list(loaded.buffers()))
    dense24 = sum(m.out_features * m.in_features * 2 for m in loaded.modules() if isinstance(m, kp.nn.Sparse24Linear))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < held + dense24 // 4, f"peak {peak} B: a dense copy of the 2:4 layers ({dense24} B) reached the GPU?"
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        out, ref = loaded(ids.cuda()).logits.float().cpu(), model.float()(ids).logits
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.gpu
def test_a_model_sparsified_on_the_gpu_saves_with_save_pretrained_and_loads_back_bit_for_bit(tmp_path, seed):
    """The device layout is unpacked to the public format as the state_dict is written, and packed again on load.
    (The whole model's logits are not compared bit for bit: ``.to(bfloat16)`` casts the rotary embedding's
    ``inv_freq`` buffer, which a model built in bfloat16 keeps in float32.)"""
    model = _llama(tie=False).to("cuda", torch.bfloat16)
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    loaded = hf.load_model(tmp_path, "cuda")
    saved, got = model.state_dict(), loaded.state_dict()
    assert sorted(saved) == sorted(got) and all(torch.equal(saved[k], got[k]) for k in saved)
    pairs = [(m, loaded.get_submodule(n)) for n, m in model.named_modules() if isinstance(m, kp.nn.Sparse24Linear)]
    assert len(pairs) == 14
    for mine, theirs in pairs:
        assert theirs.layout == mine.layout != "public" and theirs.values.is_cuda
        assert torch.equal(theirs.values, mine.values) and torch.equal(theirs.metadata, mine.metadata)
        x = torch.randn(5, 3, mine.in_features, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(theirs.forward_alone(x), mine.forward_alone(x))


@pytest.mark.parametrize("fmt", hf.FORMATS)
def test_a_dense_directory_sparsified_shard_by_shard_is_what_the_in_memory_path_writes(tmp_path, seed, fmt):
    dense = _llama(tie=False)
    dense.save_pretrained(tmp_path / "dense", max_shard_size="60KB")  # several shards
    assert len(list((tmp_path / "dense").glob("*.safetensors"))) > 2
    report = hf.sparsify_directory(tmp_path / "dense", tmp_path / "streamed", fmt)
    reference = hf.load_model(tmp_path / "dense")
    expected = kp.sparsify(reference, progress=False)
    assert sorted(report.converted) == sorted(expected.converted) and report.skipped == expected.skipped
    assert "lm_head" in report.skipped and "model.embed_tokens" in report.skipped  # as kp.sparsify decides
    hf.save_model(reference, tmp_path / "in-memory", fmt)
    a, b = hf.load_model(tmp_path / "streamed"), hf.load_model(tmp_path / "in-memory")
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert hf.checkpoint_format(hf.read_config(tmp_path / "streamed")) == fmt
    # the command takes this path where nothing needs the model in memory
    run = kernelplan_cli("sparsify", tmp_path / "dense", tmp_path / "cli", "--format", fmt)
    assert run.returncode == 0 and "shard by shard" in run.stdout, run.stderr
    if fmt == "kernelplan":  # the command says how to load it, and transformers' own loader does
        assert "from_pretrained(DIR) once kp.hf.register_quantizer() has run" in run.stdout
        hf.register_quantizer()
        native = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
        sn = native.state_dict()
        assert sorted(sn) == sorted(sa) and all(torch.equal(sn[k], sa[k]) for k in sa)
    else:
        assert "load it with kp.hf.load_model(DIR); transformers reads" in run.stdout
    with pytest.raises(InvalidProblem, match="2:4 checkpoint already"):
        hf.sparsify_directory(tmp_path / "streamed", tmp_path / "again", fmt)


@pytest.mark.parametrize("head", ["BertModel", "BertForSequenceClassification"])
def test_a_model_of_another_head_loads_as_the_class_its_config_names(tmp_path, seed, head):
    """load_model and the shard-by-shard sparsify build the class config.json's ``architectures`` names (an encoder,
    a classifier), whose parameter names the checkpoint holds: a causal LM's are others (``bert.`` before them)."""
    import copy

    config = transformers.BertConfig(vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_labels=3)
    dense = getattr(transformers, head)(config).eval()
    dense.save_pretrained(tmp_path / "dense")
    sparse = copy.deepcopy(dense)
    expected = kp.sparsify(sparse, progress=False)
    hf.save_model(sparse, tmp_path / "saved")
    report = hf.sparsify_directory(tmp_path / "dense", tmp_path / "streamed")
    assert len(expected.converted) >= 12 and sorted(report.converted) == sorted(expected.converted)
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        want = sparse(ids)[0]
        for saved in ("saved", "streamed"):
            loaded = hf.load_model(tmp_path / saved)
            assert type(loaded) is type(dense)
            torch.testing.assert_close(loaded(ids)[0], want, rtol=0, atol=0)


# -- GPT-2: Hugging Face's Conv1D, a linear layer whose weight is stored [in, out] -------------------------------------

def _gpt2():
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def _masked_dense(dense, sparse, names):
    """``dense`` with each converted Conv1D's weight replaced by its 2:4 layer's, transposed back: the reference."""
    with torch.no_grad():
        for name in names:
            dense.get_submodule(name).weight.copy_(sparse.get_submodule(name).to_dense().t())
    return dense


def test_gpt2s_conv1d_layers_are_sparsified_as_linear_layers_and_its_mlps_routed(seed):
    model = _gpt2()
    reference = _gpt2()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        want_fc = prune(model.transformer.h[0].mlp.c_fc.weight.t())  # groups of 4 along the inputs
    report = kp.sparsify(model, progress=False)
    per_block = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert sorted(report.converted) == sorted(f"transformer.h.{i}.{n}" for i in range(2) for n in per_block)
    assert "lm_head" in report.skipped  # tied to the token embeddings
    fc = model.transformer.h[0].mlp.c_fc
    assert isinstance(fc, kp.nn.Sparse24Linear) and (fc.out_features, fc.in_features) == (256, 64)
    assert torch.equal(fc.to_dense(), want_fc)
    _masked_dense(reference, model, report.converted)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    route = kp.nn.activated.activated_mlp_of(model.transformer.h[0].mlp)  # c_fc, gelu_new, c_proj, dropout
    assert route is not None and route.activation == "gelu_tanh" and route.stats["fused"] == 1 and route.checked


def test_gpt2_is_pruned_with_calibration_as_a_model_of_linear_layers(seed):
    """SparseGPT reads each Conv1D's inputs through the linear layer that replaced it: error under magnitude's."""
    model, ids = _gpt2(), torch.randint(0, 96, (8, 32))
    magnitude = _gpt2()
    magnitude.load_state_dict(model.state_dict())
    got = kp.sparsify(model, progress=False, method="sparsegpt", calibration=ids, report=True)
    base = kp.sparsify(magnitude, progress=False, method="magnitude", calibration=ids, report=True)
    assert sorted(got.errors) == sorted(base.errors) and len(got.errors) == 8
    assert all(got.errors[n] < base.errors[n] for n in got.errors)


@pytest.mark.parametrize("fmt", ["kernelplan", "sparse-24-bitmask"])
def test_a_sparsified_gpt2_round_trips_and_its_directory_sparsifies_shard_by_shard(tmp_path, seed, fmt):
    model = _gpt2()
    model.save_pretrained(tmp_path / "dense", max_shard_size="60KB")
    kp.sparsify(model, progress=False)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    hf.save_model(model, tmp_path / "in-memory", fmt)
    loaded = hf.load_model(tmp_path / "in-memory")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    assert sum(isinstance(m, kp.nn.Sparse24Linear) for m in loaded.modules()) == 8
    report = hf.sparsify_directory(tmp_path / "dense", tmp_path / "streamed", fmt)
    assert len(report.converted) == 8 and hf.checkpoint_format(hf.read_config(tmp_path / "streamed")) == fmt
    streamed = hf.load_model(tmp_path / "streamed")
    sa, sb = streamed.state_dict(), loaded.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(m.from_conv1d for m in streamed.modules() if isinstance(m, kp.nn.Sparse24Linear))


def test_the_dense_format_refuses_gpt2s_conv1d_layers_and_writes_nothing(tmp_path, seed):
    model = _gpt2()
    model.save_pretrained(tmp_path / "dense")
    kp.sparsify(model, progress=False)
    with pytest.raises(InvalidProblem, match=r"format='dense' cannot hold transformer.h.0.attn.c_attn \(8 such"):
        hf.save_model(model, tmp_path / "out", "dense")
    with pytest.raises(InvalidProblem, match="Conv1D, whose checkpoints store the weight transposed"):
        hf.sparsify_directory(tmp_path / "dense", tmp_path / "streamed", "dense")
    assert not (tmp_path / "out").exists() and not (tmp_path / "streamed").exists()


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral", "Mixtral", "Gemma2", "Phi3", "GPT2"])
def test_load_models_uninitialized_build_computes_every_buffer_as_the_normal_build(seed, family):
    """load_model builds under transformers' no_init_weights (weights left empty: each is loaded or the load is
    refused); buffers no checkpoint holds, such as rotary frequencies, must still be computed."""
    small = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, pad_token_id=0) if family != "GPT2" else dict(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    config = getattr(transformers, f"{family}Config")(**small)
    normal = transformers.AutoModelForCausalLM.from_config(config)
    empty = hf._skeleton(config, None)
    buffers = dict(normal.named_buffers())
    assert buffers.keys() == dict(empty.named_buffers()).keys()
    for name, buffer in empty.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    ties = lambda m: {n for n, p in m.named_parameters(remove_duplicate=False) if p is m.get_input_embeddings().weight}
    assert ties(empty) == ties(normal)
