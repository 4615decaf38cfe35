"""transformers' own from_pretrained on kernelplan 2:4 directories (``kernelplan/hf_quantizer.py``)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

import kernelplan as kp
from kernelplan import hf
from kernelplan.errors import InvalidProblem

transformers = pytest.importorskip("transformers")

from test_hf import _gpt2, _llama  # noqa: E402


def _sparse_layers(model) -> dict[str, kp.nn.Sparse24Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, kp.nn.Sparse24Linear)}


def _same_state(a, b) -> None:
    """Both models' (or state_dicts') tensors bit for bit: 2:4 layers in the public format, the rest as held."""
    sa, sb = (x if isinstance(x, dict) else x.state_dict() for x in (a, b))
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _fp64_logits(model, ids):
    """The model's function in float64 with every 2:4 layer decompressed: the reference a load must reproduce."""
    import copy

    twin = copy.deepcopy(model).double()
    for name, layer in _sparse_layers(twin).items():
        dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None).double()
        with torch.no_grad():
            dense.weight.copy_(layer.to_dense())
            if layer.bias is not None:
                dense.bias.copy_(layer.bias)
        parent = twin.get_submodule(name.rpartition(".")[0])
        setattr(parent, name.rpartition(".")[2], dense)
    with torch.no_grad():
        return twin(ids).logits


@pytest.mark.parametrize("build, save", [("llama", "save_pretrained"), ("llama", "save_model"),
                                         ("gpt2", "save_pretrained")])
def test_from_pretrained_builds_the_2_4_layers_of_a_kernelplan_directory(tmp_path, seed, build, save):
    model = _llama() if build == "llama" else _gpt2()
    kp.sparsify(model, progress=False)
    if save == "save_pretrained":
        model.save_pretrained(tmp_path, max_shard_size="60KB")
    else:
        hf.save_model(model, tmp_path, max_shard_bytes=60_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    layers = _sparse_layers(loaded)
    assert len(layers) == (14 if build == "llama" else 8)
    assert {m.layout for m in layers.values()} == {"sp tiled"}  # the device layout, one copy
    assert {type(m) for m in layers.values()} == {kp.nn.Sparse24Linear}
    assert all(m.from_conv1d == (build == "gpt2") for m in layers.values())
    assert not any(isinstance(m, torch.nn.Linear) for n, m in loaded.named_modules() if n in _sparse_layers(model))
    _same_state(loaded, model)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        got = loaded(ids).logits.double()
    ref = _fp64_logits(model, ids)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert loaded.is_quantized and loaded.config.quantization_config.format == "kernelplan.sparse24"
    # Saved again through transformers, it is the same directory for both loaders.
    loaded.save_pretrained(tmp_path / "again")
    _same_state(hf.load_model(tmp_path / "again"), model)
    _same_state(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again"), model)


def test_from_pretrained_casts_the_kept_values_to_the_dtype_asked_for(tmp_path, seed):
    model = _llama()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    layer = loaded.model.layers[1].mlp.down_proj
    want = model.model.layers[1].mlp.down_proj
    assert layer.values.dtype == torch.bfloat16
    assert torch.equal(layer.weight24.public().metadata, want.weight24.public().metadata)
    assert torch.equal(layer.to_dense(), want.to_dense().bfloat16())


def test_a_fresh_process_loads_a_directory_once_it_registers_the_quantizer(tmp_path, seed):
    model = _llama()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    code = ("import sys, transformers, kernelplan as kp\n"
            "kp.hf.register_quantizer(); kp.hf.register_quantizer()\n"  # idempotent
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "print(sum(isinstance(x, kp.nn.Sparse24Linear) for x in m.modules()))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "14"


def test_a_directory_written_with_the_earlier_top_level_record_still_loads(tmp_path, seed):
    """Before the quantizer (4d8d57f), kernelplan recorded its format as config.json's top-level ``kernelplan``."""
    model = _llama()
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["kernelplan"] = {"format": "kernelplan.sparse24", "format_version": 1}
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf.checkpoint_format(hf.read_config(tmp_path)) == "kernelplan"
    loaded = hf.load_model(tmp_path)
    _same_state(loaded, model)
    assert loaded.config.quantization_config["quant_method"] == "kernelplan"
    assert "kernelplan" not in vars(loaded.config)  # one record, in the new place


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, match", [
    ({"format_version": 2}, "newer than this kernelplan's 1: upgrade"),
    ({"format": "kernelplan.sparse48"}, "names format 'kernelplan.sparse48'"),
    ({"block": 16}, r"holds \['block'\], which kernelplan format version 1 does not write")])
def test_from_pretrained_refuses_a_record_this_kernelplan_cannot_read(tmp_path, seed, changes, match):
    model = _llama()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(InvalidProblem, match=match):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_refuses_metadata_that_is_not_2_4(tmp_path, seed):
    from safetensors.torch import load_file, save_file

    model = _llama()
    kp.sparsify(model, progress=False)
    hf.save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.metadata"
    tensors[name][3, 2] = 0  # both groups of the word keep position 0 twice
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidProblem, match="metadata"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def _sparse_moe(kind: str):
    """A small MoE model with its experts 2:4: Mixtral (saved under transformers' renames: mlp as block_sparse_moe),
    gpt-oss (experts transposed, with biases) or Llama-4 (every token through every expert)."""
    from test_experts import _gpt_oss_model, _mixtral
    from test_experts_every_token import _llama4_model

    model = {"mixtral": lambda: _mixtral(torch.float32), "gpt-oss": _gpt_oss_model,
             "llama4": lambda: _llama4_model(torch.float32, vocab=256)}[kind]()
    kp.sparsify(model, progress=False, experts="all")
    return model


@pytest.mark.parametrize("loader", ["from_pretrained", "load_model"])
@pytest.mark.parametrize("kind", ["mixtral", "gpt-oss", "llama4"])
def test_both_loaders_read_a_sparsified_moe_models_own_save_pretrained(tmp_path, seed, kind, loader):
    """save_pretrained writes a Sparse24Experts' state_dict, one layer an expert (<experts>.first.<e>), under the
    names transformers saves the model by; both loaders rename them back as transformers' loader does and build one
    Sparse24Experts, equal to the saved one bit for bit."""
    from safetensors import safe_open

    model = _sparse_moe(kind)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    keys = {k for f in tmp_path.glob("*.safetensors") for k in safe_open(f, "pt").keys()}
    renamed = {"mixtral": "block_sparse_moe", "gpt-oss": "mlp", "llama4": "feed_forward"}[kind]  # the rename this test
    assert f"model.layers.1.{renamed}.experts.first.2.values" in keys  # is about, where there is one
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path) if loader == "from_pretrained" else \
        hf.load_model(tmp_path)
    assert sum(isinstance(m, kp.nn.Sparse24Experts) for m in loaded.modules()) == 2
    _same_state(loaded, model)
    ids = torch.randint(0, 256, (2, 9))
    # float64 gpt-oss: the dense lm_head's product differs in its last bit after from_pretrained (every layer before
    # it agrees exactly)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-13 * (kind == "gpt-oss"))


@pytest.mark.parametrize("kind", ["mixtral", "gpt-oss", "llama4"])
def test_from_pretrained_lays_each_expert_out_as_transformers_loads_it(tmp_path, seed, monkeypatch, kind):
    """A save_pretrained MoE directory (one layer an expert): where the conversion kernels run, each expert is
    converted into its rows of the projection's span as soon as the loader has set its values and metadata, so that
    no other expert holds checkpoint tensors then (every expert's were held until the load ended: 0047); the span is
    held as written, and the model equals the saved one.  The kernel's place is taken by the torch ops."""
    from kernelplan import hf_quantizer
    from kernelplan.nn import experts as module
    from kernelplan.sparse24 import layout

    model = _sparse_moe(kind)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    holders, packed = [], []  # every holder made, kept alive; (holders holding checkpoint tensors, rows) a conversion

    class TorchOps:
        @staticmethod
        def pack_into(values, metadata, tv, tm):
            public = sum(not h.values.is_meta and h.values.dim() == 2 for h in holders)
            packed.append((public, tv.data_ptr()))
            tv.copy_(layout.pack_values(values))
            tm.copy_(layout.pack_metadata(metadata))

    made = hf_quantizer._ExpertHolder.__init__

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        holders.append(self)

    monkeypatch.setattr(hf_quantizer._ExpertHolder, "__init__", kept)
    monkeypatch.setattr(module, "gpu_kernels", lambda t: TorchOps)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    experts = 3 if kind == "gpt-oss" else 4
    assert len(holders) == len(packed) == 2 * 2 * experts  # layers x projections x experts, each converted once
    assert {public for public, _ in packed} == {1}  # the expert converted alone holds its checkpoint's tensors
    for experts in (m for m in loaded.modules() if isinstance(m, kp.nn.Sparse24Experts)):
        held = {layer.values.data_ptr() for layers in (experts.first, experts.down) for layer in layers}
        assert held <= {rows for _, rows in packed}  # the rows written as loaded: no copy made after
    _same_state(loaded, model)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-13 * (kind == "gpt-oss"))


@pytest.mark.parametrize("kind", ["mixtral", "gpt-oss", "llama4"])
def test_dequantize_gives_back_the_experts_modules_with_the_pruned_weights(tmp_path, seed, kind):
    """``dequantize`` of a loaded MoE model: each Sparse24Experts becomes the transformers experts module it was built
    from, holding ``dense_parts``; the model computes what the 2:4 one did, and saves a plain dense directory."""
    model = _sparse_moe(kind)
    model.save_pretrained(tmp_path / "sparse")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    parts = {n: m.dense_parts() for n, m in loaded.named_modules() if isinstance(m, kp.nn.Sparse24Experts)}
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = loaded(ids).logits
    dense = loaded.dequantize()
    assert not any(isinstance(m, (kp.nn.Sparse24Experts, kp.nn.Sparse24Linear)) for m in dense.modules())
    for name, held in parts.items():
        experts = dense.get_submodule(name)
        assert type(experts).__name__ in ("MixtralExperts", "GptOssExperts", "Llama4TextExperts")
        assert {k: v for k, v in experts.named_parameters()}.keys() == held.keys()
        assert all(torch.equal(getattr(experts, k), v) for k, v in held.items())
    dense.config._experts_implementation = "eager"  # transformers' reference loop: grouped_mm refuses float64
    with torch.no_grad():  # transformers' own experts loop against the 2:4 layers, on the same pruned weights
        torch.testing.assert_close(dense(ids).logits, want, rtol=0, atol=1e-12 if kind == "gpt-oss" else 1e-5)
    dense.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in hf.read_config(tmp_path / "dense")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert not _sparse_layers(again)
    again.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, dense(ids).logits, rtol=0, atol=1e-12 if kind == "gpt-oss"
                                   else 1e-5)


def test_dequantize_refuses_experts_not_built_from_a_transformers_module_and_changes_nothing(seed):
    from kernelplan.hf_quantizer import Sparse24QuantConfig, Sparse24Quantizer

    model = _sparse_moe("mixtral")
    built = model.model.layers[1].mlp.experts
    bare = kp.nn.Sparse24Experts(list(built.first), list(built.down), built.act_fn)  # no module to give back
    model.model.layers[1].mlp.experts = bare
    quantizer = Sparse24Quantizer(Sparse24QuantConfig(), pre_quantized=True)
    with pytest.raises(InvalidProblem, match=r"not built from a transformers experts module.*format='dense'"):
        quantizer._dequantize(model)
    assert isinstance(model.model.layers[0].mlp.experts, kp.nn.Sparse24Experts)  # converted before any is put back
    assert isinstance(model.model.layers[0].self_attn.q_proj, kp.nn.Sparse24Linear)


@pytest.mark.parametrize("damage, match", [("an expert missing", r"gate_up_proj: the checkpoint holds 2:4 layers "
                                                                 r"of experts \[0, 1, 3\] \(3\).*has 4 experts"),
                                           ("an expert's shape", r"down_proj: the checkpoint holds 4 2:4 experts of "
                                                                 r"\[128, \d+\] or \[128, \d+\]"),
                                           ("metadata", "metadata")])
@pytest.mark.parametrize("loader", ["from_pretrained", "load_model"])
def test_both_loaders_refuse_per_expert_layers_that_do_not_fit_the_model_or_are_not_2_4(tmp_path, seed, damage,
                                                                                       match, loader):
    from safetensors.torch import load_file, save_file

    model = _sparse_moe("mixtral")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts"
    if damage == "an expert missing":
        for leaf in ("values", "metadata"):
            del tensors[f"{name}.first.2.{leaf}"]
    elif damage == "an expert's shape":  # expert 1's down projection cut to half its inputs
        for leaf in ("values", "metadata"):
            tensors[f"{name}.down.1.{leaf}"] = tensors[f"{name}.down.1.{leaf}"][:, ::2].contiguous()
    else:
        tensors[f"{name}.down.3.metadata"][5, 1] = 0  # both groups of the word keep position 0 twice
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    if damage == "metadata" and loader == "from_pretrained":  # read as the load ends, naming the expert
        match = r"layers\.1\.mlp\.experts\.down_proj, expert 3: its metadata holds a word that is not 2:4"
    with pytest.raises(InvalidProblem, match=match):
        if loader == "from_pretrained":
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        else:
            hf.load_model(tmp_path)


def test_from_pretrained_builds_stacked_2_4_experts_as_load_model_does(tmp_path, seed):
    """A MoE model's experts, stacked and 2:4 as kp.hf.save_model writes them, become one Sparse24Experts each."""
    from test_experts import _mixtral

    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="all")
    hf.save_model(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum(isinstance(m, kp.nn.Sparse24Experts) for m in loaded.modules()) == 2
    reference = hf.load_model(tmp_path)
    _same_state(loaded, reference)
    _same_state(loaded, model)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("damage, match", [("fewer experts", r"experts.down_proj: the checkpoint holds 3 2:4 "
                                                            r"experts of \[128, 96\].*has 4 experts"),
                                           ("metadata", "metadata")])
def test_from_pretrained_refuses_stacked_experts_that_do_not_fit_the_model_or_are_not_2_4(tmp_path, seed, damage,
                                                                                          match):
    from safetensors.torch import load_file, save_file
    from test_experts import _mixtral

    model = _mixtral(torch.float32)
    kp.sparsify(model, progress=False, experts="all")
    hf.save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    if damage == "fewer experts":  # 3 experts where the model has 4
        for leaf in ("values", "metadata"):
            tensors[f"{name}.{leaf}"] = tensors[f"{name}.{leaf}"][:3].contiguous()
    else:
        tensors[f"{name}.metadata"][2, 5, 1] = 0  # expert 2: both groups of the word keep position 0 twice
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidProblem, match=match):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_the_quantizer_refuses_a_dense_checkpoint_and_a_loader_without_the_file_list(tmp_path, seed):
    from kernelplan.hf_quantizer import Sparse24QuantConfig, Sparse24Quantizer

    hf.register_quantizer()
    _llama().save_pretrained(tmp_path)
    with pytest.raises(InvalidProblem, match=r"loads checkpoints that are 2:4 already.* kp.sparsify\(model\)"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=Sparse24QuantConfig())
    quantizer = Sparse24Quantizer(Sparse24QuantConfig(), pre_quantized=True)
    model = _llama()
    with pytest.raises(InvalidProblem, match=r"does not hand a quantizer the checkpoint's files.*not a local "
                                             r"directory.*kp.hf.load_model"):
        quantizer.preprocess_model(model)
    assert not _sparse_layers(model)  # nothing replaced


def test_from_pretrained_refuses_a_device_map_that_offloads_to_disk(tmp_path, seed):
    model = _llama()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    split = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
             "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with pytest.raises(InvalidProblem, match="device_map places modules on 'disk'"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=split,
                                                          offload_folder=str(tmp_path / "offload"))


def test_sparsify_refuses_a_model_quantized_by_another_method_before_changing_it(seed):
    model = _llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(InvalidProblem, match="quant_method 'bitsandbytes'"):
        kp.sparsify(model, progress=False)
    assert not _sparse_layers(model) and model.config.quantization_config["quant_method"] == "bitsandbytes"


def _loaded_on_the_gpu(tmp_path):
    """A sparsified bf16 Llama, and the same loaded back by from_pretrained with device_map="cuda": its 2:4 layers
    there, in the device layout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _llama().to(torch.bfloat16)
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    layers = _sparse_layers(loaded)
    assert {m.values.device.type for m in layers.values()} == {"cuda"}
    assert {m.layout for m in layers.values()} == {"sp tiled"}
    return model, loaded


@pytest.mark.gpu
def test_on_the_gpu_from_pretrained_with_a_device_map_loads_the_2_4_layers_there(tmp_path, seed):
    model, loaded = _loaded_on_the_gpu(tmp_path)
    _same_state(loaded.cpu(), model)
    loaded.cuda()
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        got = loaded(ids.cuda()).logits.double().cpu()
    ref = _fp64_logits(model, ids)
    # bf16 through the whole model: the repository's whole-model bf16 tolerance (tests/test_hf.py)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["from_pretrained", "load_model"])
@pytest.mark.parametrize("build", ["llama", "mixtral"])
def test_on_the_gpu_loading_peaks_at_what_the_model_holds_plus_one_experts_module(tmp_path, seed, loader, build,
                                                                                   monkeypatch):
    """The GPU memory a load peaks at, over what the loaded model holds, stays under one embedding table and, for a
    MoE model, a quarter of a layer's 2:4 experts: the plain tensors reach the device once (0044: load_model's
    reached it twice, 1.68x its result), and a layer's checkpoint experts are freed as they are laid out straight
    into one span (0045: load_model held every layer's until the last was built, then each expert's own layout sat
    beside the span, then the checkpoint's tensors did; from_pretrained read 1.07, 0.48 and now 0.15 layers over the
    embedding, load_model 0.39 and now 0.02).

    from_pretrained is measured without transformers' loader threads (``HF_DEACTIVATE_ASYNC_LOAD=1``): with them, the
    threads bring the checkpoint onto the device ahead of the thread that sets each tensor, and the peak is theirs
    (a dense model's load too: 1.88 GB over at Mixtral-8x7B's sizes, 0.86 GB without; 0047)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    sizes = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=2 if build == "llama"
                 else 6, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    if build == "llama":
        config = transformers.LlamaConfig(**sizes)
    else:
        config = transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    kp.sparsify(model, progress=False, experts="all")
    model.save_pretrained(tmp_path)
    del model
    hf.register_quantizer()
    gc.collect()  # earlier tests' models freed now, not while this load is measured
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if loader == "load_model":
        loaded = hf.load_model(tmp_path, device="cuda")
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    torch.cuda.synchronize()
    held, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    embedding = 8192 * 512 * 2
    experts = 4 * 3 * 512 * 1024 * 2 * 9 // 16  # a layer's experts, 2:4 (0.5625x of bf16's bytes)
    assert {m.values.device.type for m in _sparse_layers(loaded).values()} == {"cuda"}
    assert peak - held < embedding + (experts // 4 if build == "mixtral" else 0), (peak, held)


@pytest.mark.gpu
@pytest.mark.parametrize("save", ["save_model", "save_pretrained"])
def test_on_the_gpu_from_pretrained_builds_2_4_experts_stacked_or_per_expert(tmp_path, seed, save):
    """A MoE model's 2:4 experts, stacked (kp.hf.save_model) or one layer an expert under transformers' renames
    (save_pretrained), loaded with device_map="cuda": one Sparse24Experts a layer in the device layout, against the
    float64 twin of the saved model."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from test_experts import _dense_twin, _mixtral

    base = _mixtral(torch.float32, top_k=4)  # every token to every expert: bf16 cannot flip a top-k choice
    model = copy.deepcopy(base).to(torch.bfloat16)
    kp.sparsify(model, progress=False, experts="all")
    if save == "save_model":
        hf.save_model(model, tmp_path)
    else:
        model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    experts = [m for m in loaded.modules() if isinstance(m, kp.nn.Sparse24Experts)]
    assert len(experts) == 2
    assert {layer.values.device.type for e in experts for layer in [*e.first, *e.down]} == {"cuda"}
    assert {layer.layout for e in experts for layer in [*e.first, *e.down]} == {"sp tiled"}
    _same_state(loaded.cpu(), model)
    loaded.cuda()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        got = loaded(ids.cuda()).logits.double().cpu()
        ref = _dense_twin(model, base).double()(ids).logits
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()  # bf16 through the whole model (tests/test_hf.py)
    dense = loaded.dequantize()  # the experts modules back, their weights unpacked from the device layout
    twin = _dense_twin(model, base)
    for name, module in twin.named_modules():
        if type(module).__name__ == "MixtralExperts":
            held = dense.get_submodule(name)
            assert type(held).__name__ == "MixtralExperts" and held.gate_up_proj.device.type == "cuda"
            for part in ("gate_up_proj", "down_proj"):
                assert torch.equal(getattr(held, part).cpu(), getattr(module, part).to(torch.bfloat16)), (name, part)


@pytest.mark.gpu
def test_on_the_gpu_dequantize_gives_back_the_pruned_weights_from_the_device_layout(tmp_path, seed):
    model, loaded = _loaded_on_the_gpu(tmp_path)
    dense = loaded.dequantize()
    assert not _sparse_layers(dense)
    for name, layer in _sparse_layers(model).items():
        got = dense.get_submodule(name).weight
        assert got.device.type == "cuda" and torch.equal(got.cpu(), layer.to_dense()), name


@pytest.mark.parametrize("build", ["llama", "gpt2"])
def test_dequantize_gives_back_the_dense_modules_with_the_pruned_weights(tmp_path, seed, build):
    """``model.dequantize()`` of a model from_pretrained loaded: plain transformers layers holding the 2:4 weights,
    its routes detached, and a save_pretrained that transformers reads with no kernelplan record."""
    model = _llama() if build == "llama" else _gpt2()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path / "sparse")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        loaded(ids)  # the MLPs' routes are checked and run
    names = _sparse_layers(loaded)
    dense = loaded.dequantize()
    assert not _sparse_layers(dense) and not dense.is_quantized
    assert not hasattr(dense.config, "quantization_config")
    kind = "Conv1D" if build == "gpt2" else "Linear"
    for name, layer in names.items():
        got = dense.get_submodule(name)
        assert type(got).__name__ == kind
        weight = got.weight.t() if build == "gpt2" else got.weight
        assert torch.equal(weight, layer.to_dense()) and kp.sparse24.is_sparse24(weight)
    assert not any(kp.nn.routes.route_of(m) for m in dense.modules())
    ref = _fp64_logits(model, ids)
    with torch.no_grad():
        got = dense(ids).logits.double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    dense.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in hf.read_config(tmp_path / "dense")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    assert not _sparse_layers(again)
    _same_state(again, dense)


def test_transformers_trainer_fine_tunes_the_kept_values_of_a_loaded_model(tmp_path, seed):
    """A model from_pretrained loaded is quantized to transformers, whose Trainer fine-tunes one only where the
    quantizer says it trains (is_qat_trainable): the 2:4 values move, the masks stay."""
    model = _llama()
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path / "sparse")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    layers = _sparse_layers(loaded)
    before = {n: (m.values.detach().clone(), m.metadata.clone()) for n, m in layers.items()}
    ids = torch.randint(0, 96, (8, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                          learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no")
    transformers.Trainer(model=loaded, args=args, train_dataset=data).train()
    for name, layer in layers.items():
        assert torch.equal(layer.metadata, before[name][1])
    assert all(not torch.equal(m.values, before[n][0]) for n, m in layers.items())
