"""``sparsify``, compressed safetensors checkpoints and the ``kernelplan sparsify`` command."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import kernelplan as kp
from kernelplan.errors import InvalidProblem
from helpers import kernelplan_cli


def _model():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.Sequential(nn.Linear(16, 20), nn.Linear(20, 4)))


def test_sparsify_swaps_eligible_linears_and_matches_the_masked_dense_model(seed):
    model = _model()
    dense = _model()
    dense.load_state_dict(model.state_dict())
    report = kp.sparsify(model, progress=False)
    assert report.converted == ["0", "2", "3.0"]
    assert report.skipped == {"3.1": "in_features=20 is not a multiple of 8"}
    assert report.bytes_before == 4 * (64 * 32 + 32 * 16 + 16 * 20)
    # As held: layers 0 (32x64) and 2 (16x32, K padded to 64) in the device layout (4-bit positions), 3.0 (20 rows,
    # off its 16-row tile) in the public format.
    held = sum(m * k // 2 * 4 + m * k // 8 for m, k in ((32, 64), (16, 64))) + 20 * 16 // 2 * 4 + 20 * 16 // 8 * 2
    assert report.bytes_after == held and report.padded == {"2": (16 * 64 // 2 * 4 + 16 * 64 // 8) // 2}
    assert model[0].layout == model[2].layout == "sp tiled" and model[3][0].layout == "public"
    # 3.0's copy the GPU kernels derive: 32 rows (20 padded to the 16-row tile) of K = 16 padded to 64, 4-byte values.
    assert report.derived_on_gpu == {"3.0": 32 * 64 // 2 * 4 + 32 * 64 // 8}
    line = next(ln for ln in report.summary().splitlines() if "public format" in ln)
    assert "not a multiple of 16" in line and line.endswith(": 3.0")
    assert isinstance(model[0], kp.nn.Sparse24Linear) and isinstance(model[3][1], nn.Linear)
    with torch.no_grad():
        for name in report.converted:  # the masked-dense reference: the same pruned weights, dense
            dense.get_submodule(name).weight.copy_(model.get_submodule(name).to_dense())
        x = torch.randn(5, 64)
        torch.testing.assert_close(model(x), dense(x))


def test_filter_fn_and_its_reason():
    model = _model()
    report = kp.sparsify(model, filter_fn=lambda name, layer: name != "2", progress=False)
    assert report.skipped["2"] == "filtered out by filter_fn" and "2" not in report.converted


def test_round_trip_is_bit_exact_and_loads_into_a_sparsified_model(tmp_path, seed):
    model = _model()
    kp.sparsify(model, progress=False)
    path = tmp_path / "m.safetensors"
    kp.save_compressed(model, path)
    state = kp.load_compressed(path)
    assert state.keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t) and state[name].dtype == t.dtype, name
    fresh = _model()
    kp.sparsify(fresh, progress=False)
    fresh.load_state_dict(state)
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), model(x))


def _write(path, tensors, **meta):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})


def test_newer_foreign_truncated_and_tampered_files_are_refused(tmp_path):
    model = _model()
    kp.sparsify(model, progress=False)
    good = tmp_path / "good.safetensors"
    kp.save_compressed(model, good)
    data = good.read_bytes()

    newer = tmp_path / "newer.safetensors"
    _write(newer, {"a": torch.ones(2)}, format="kernelplan.sparse24", format_version=99, sha256="x")
    with pytest.raises(InvalidProblem, match=r"format version 99, newer than this kernelplan's 1.*upgrade"):
        kp.load_compressed(newer)
    foreign = tmp_path / "foreign.safetensors"
    _write(foreign, {"a": torch.ones(2)})
    with pytest.raises(InvalidProblem, match=r"has format None, not 'kernelplan.sparse24'"):
        kp.load_compressed(foreign)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidProblem, match=r"not a readable safetensors file"):
        kp.load_compressed(truncated)
    tampered = tmp_path / "tampered.safetensors"
    tampered.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    with pytest.raises(InvalidProblem, match=r"do not match the checksum"):
        kp.load_compressed(tampered)
    with pytest.raises(InvalidProblem, match=r"does not exist"):
        kp.load_compressed(tmp_path / "missing.safetensors")


def test_tied_weights_are_saved():
    shared = nn.Linear(8, 8)
    state = {"a.weight": shared.weight, "b.weight": shared.weight}
    # safetensors itself refuses shared memory; save_compressed stores the second as a copy.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        kp.save_compressed(state, os.path.join(d, "t.safetensors"))
        loaded = kp.load_compressed(os.path.join(d, "t.safetensors"))
    assert torch.equal(loaded["a.weight"], loaded["b.weight"])


def test_sparse24_linear_casts_and_keeps_its_mask():
    layer = kp.nn.Sparse24Linear.from_dense(nn.Linear(32, 8)).to(torch.float64)
    assert layer.values.dtype == torch.float64 and layer.metadata.dtype == torch.int16
    x = torch.randn(2, 32, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)


def _cli(*args):
    return kernelplan_cli("sparsify", *args)


def test_cli_example_real_file_dry_run_filter_and_errors(tmp_path):
    example = _cli()
    assert example.returncode == 0, example.stderr
    assert "converted 2 layers" in example.stdout and "in_features=60 is not a multiple of 8" in example.stdout

    from safetensors.torch import save_file

    model = _model()
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src))
    dry = _cli(str(src), str(dst), "--dry-run")
    assert dry.returncode == 0 and not dst.exists() and "converted 3 layers" in dry.stdout
    only = _cli(str(src), str(dst), "--filter", r"^2\.")
    assert only.returncode == 0 and "converted 1 layers" in only.stdout
    assert set(kp.load_compressed(dst)) >= {"2.values", "2.metadata", "0.weight"}

    for args, text in (((str(tmp_path / "nope.safetensors"), str(dst)), "does not exist"),
                       ((str(tmp_path / "in.safetensors"),), "give both"),
                       ((str(src), str(dst), "--filter", "("), "not a valid regular expression")):
        bad = _cli(*args)
        assert bad.returncode == 2 and text in bad.stderr and "Traceback" not in bad.stdout + bad.stderr
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a checkpoint")
    bad = _cli(str(junk), str(dst))
    assert bad.returncode == 2 and "is not a safetensors file" in bad.stderr and bad.stderr.count("\n") == 1


class _TinyLM(nn.Module):
    """An embedding, two blocks and an LM head, optionally tied to the embedding (as many decoders are)."""

    def __init__(self, tied: bool, hf: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(96, 64)
        self.blocks = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.lm_head = nn.Linear(64, 96, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        if hf:  # the Hugging Face accessor names the output projection, whatever its attribute is called
            self.out_proj, self.lm_head = self.lm_head, None
            self.get_output_embeddings = lambda: self.out_proj

    def forward(self, ids):
        head = self.lm_head if self.lm_head is not None else self.out_proj
        return head(self.blocks(self.embed_tokens(ids)))


def test_sparsify_keeps_a_tied_lm_head_and_its_embedding_intact():
    model = _TinyLM(tied=True)
    report = kp.sparsify(model, progress=False)
    assert report.converted == ["blocks.0", "blocks.2"]
    assert "tied to embed_tokens.weight" in report.skipped["lm_head"]
    assert model.lm_head.weight is model.embed_tokens.weight  # the tie holds
    assert "tied to" in report.summary()


def test_sparsify_leaves_the_output_projection_dense_unless_asked():
    model = _TinyLM(tied=False)
    report = kp.sparsify(model, progress=False)
    assert "lm_head" not in report.converted and "prune_output=True" in report.skipped["lm_head"]
    pruned = _TinyLM(tied=False)
    assert "lm_head" in kp.sparsify(pruned, progress=False, prune_output=True).converted
    hf = _TinyLM(tied=False, hf=True)
    report = kp.sparsify(hf, progress=False)
    assert "out_proj" in report.skipped and isinstance(hf.out_proj, nn.Linear)
    ids = torch.randint(0, 96, (2, 5))
    assert hf(ids).shape == (2, 5, 96)


class _TopKRouter(nn.Linear):
    """A router as Phi-MoE's and Llama-4's are: an nn.Linear subclass whose forward returns its top-k too."""

    def forward(self, x):
        logits = super().forward(x)
        return logits.topk(2, dim=-1)


class _Tagged(nn.Linear):
    """A subclass that adds an attribute and keeps nn.Linear's forward."""

    tag = "kept"


def test_sparsify_leaves_a_linear_subclass_with_its_own_forward_dense_and_converts_the_others():
    model = nn.Sequential(_TopKRouter(64, 32), nn.Sequential(_Tagged(64, 32), nn.Linear(64, 16)))
    report = kp.sparsify(model, progress=False)
    assert report.converted == ["1.0", "1.1"]
    assert "_TopKRouter: an nn.Linear subclass with a forward of its own" in report.skipped["0"]
    assert type(model[0]) is _TopKRouter and isinstance(model[1][0], kp.nn.Sparse24Linear)
    values, index = model[0](torch.randn(3, 64))  # still a router
    assert values.shape == index.shape == (3, 2)


def test_sparsify_keeps_a_sparsified_phimoe_and_llama4_routing():
    """Their routers are nn.Linear subclasses returning a tuple: converted, both models failed in their first forward
    (0079)."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, num_local_experts=4)
    for config in (transformers.PhimoeConfig(num_experts_per_tok=2, **small),
                   transformers.Llama4TextConfig(num_experts_per_tok=1, head_dim=32, intermediate_size_mlp=256,
                                                 **small)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        masked = copy.deepcopy(model)
        report = kp.sparsify(model, progress=False)
        routers = [name for name in report.skipped if name.endswith("router")]
        assert routers and all("forward of its own" in report.skipped[name] for name in routers)
        ids = torch.randint(0, 100, (2, 7))
        with torch.no_grad():
            for name in report.converted:
                masked.get_submodule(name).weight.copy_(model.get_submodule(name).to_dense())
            torch.testing.assert_close(model(ids).logits, masked(ids).logits, rtol=1e-5, atol=1e-5)
