"""``kernelplan sparsify IN OUT`` on a single file, tensor by tensor (``kernelplan/stream.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernelplan as kp
from kernelplan.checkpoint import sparsify_state_dict
from kernelplan.errors import InvalidProblem
from kernelplan.stream import sparsify_file


def _mixed_state():
    """Every kind of tensor a checkpoint holds: pruned, skipped (and why), kept, odd dtypes and shapes."""
    return {
        "model.embed_tokens.weight": torch.randn(96, 64, dtype=torch.bfloat16),  # skipped: an embedding
        "model.layers.0.q.weight": torch.randn(48, 64, dtype=torch.bfloat16),
        "model.layers.0.q.bias": torch.randn(48, dtype=torch.bfloat16),
        "model.layers.0.q.norm.weight": torch.randn(48, dtype=torch.bfloat16),  # between q.metadata and q.values
        "model.layers.0.odd.weight": torch.randn(24, 60, dtype=torch.bfloat16),  # skipped: K % 8
        "model.layers.0.up.weight": torch.randn(40, 32, dtype=torch.float16),
        "model.layers.0.f32.weight": torch.randn(16, 64),  # skipped: dtype
        "model.step": torch.tensor(7),  # 0-d int
        "model.mask": torch.rand(5, 3) > 0.5,
        "model.ids": torch.arange(12, dtype=torch.int32).view(3, 4),
        "model.empty": torch.empty(0, 8, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("pattern", [None, r"layers\.0\.(q|up)\."])
def test_a_file_streamed_reads_back_as_sparsify_state_dict_makes_it(tmp_path, seed, pattern):
    from safetensors.torch import save_file

    state = _mixed_state()
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(state, str(src))
    report = sparsify_file(str(src), str(dst), pattern)
    expected, expected_report = sparsify_state_dict(state, pattern)
    got = kp.load_compressed(dst)  # the checksum and the 2:4 metadata checked on the way
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    assert (sorted(report.converted), report.skipped, report.bytes_after) == (
        sorted(expected_report.converted), expected_report.skipped, expected_report.bytes_after)
    assert sorted(report.converted) == sorted(["model.layers.0.q", "model.layers.0.up"] + (
        ["model.layers.0.f32"] if pattern is None else []))


def test_a_dry_run_writes_nothing_and_errors_name_the_problem_and_write_nothing(tmp_path):
    from safetensors.torch import save_file

    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(_mixed_state(), str(src))
    assert sparsify_file(str(src), str(dst), dry_run=True).converted and not dst.exists()
    with pytest.raises(InvalidProblem, match="not a valid regular expression"):
        sparsify_file(str(src), str(dst), "(")
    with pytest.raises(InvalidProblem, match="does not exist"):
        sparsify_file(str(tmp_path / "missing.safetensors"), str(dst))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10" + bytes(20))
    with pytest.raises(InvalidProblem, match="not a safetensors file"):
        sparsify_file(str(junk), str(dst))
    with pytest.raises(InvalidProblem, match="does not exist; create it"):
        sparsify_file(str(src), str(tmp_path / "no" / "out.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "junk.safetensors"]


def test_the_command_holds_a_layer_at_a_time_not_the_file(tmp_path):
    """Peak RSS of `kernelplan sparsify` on a 512 MiB file of 64 layers, over a process that only imports the same:
    it scales with the largest layer (pruning one takes several times its bytes), not with the file.  (On 256 MiB of
    32 layers it read 78-106 MiB, mostly a fixed first-call cost: the same with 64 layers of half the size.)"""
    from safetensors.torch import save_file

    src, dst = tmp_path / "big.safetensors", tmp_path / "out.safetensors"
    save_file({f"layers.{i}.weight": torch.randn(2048, 2048).to(torch.bfloat16) for i in range(64)}, str(src))
    size = src.stat().st_size
    probe = textwrap.dedent("""
        import re, sys
        import torch, safetensors, kernelplan.cli, kernelplan.stream, kernelplan.sparse24.format
        status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
        base = status("VmRSS") * 1024
        kernelplan.cli.main(["sparsify", sys.argv[1], sys.argv[2]])
        print(status("VmHWM") * 1024 - base)
    """)
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    run = subprocess.run([sys.executable, "-c", probe, str(src), str(dst)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr
    extra = int(run.stdout.split()[-1])
    # values and the public format's metadata: 0.625x
    assert "converted 64 layers" in run.stdout and dst.stat().st_size < 0.65 * size
    assert extra < 0.4 * size, f"peak RSS {extra / 2**20:.0f} MiB over the imports, for a {size / 2**20:.0f} MiB file"


def _gpt2(tmp_path):
    """A tiny GPT-2 (transformers' GPT2Model: Conv1D projections, weights stored [in, out]) and its file."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=96, n_positions=32)
    model = transformers.GPT2Model(cfg).eval()
    src = tmp_path / "gpt2.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src))
    return model, src


def test_gpt2s_conv1d_weights_are_pruned_as_the_linear_layers_kp_sparsify_makes(tmp_path, seed):
    """A GPT-2 file's Conv1D weights ([in, out]) are pruned along their inputs and written as the linear layer's
    [out, in]: the file loads into the model kp.sparsify makes of the same weights, tensor for tensor, and runs as it
    does.  Read as stored, they were pruned along the outputs (the wrong axis) and did not load."""
    import copy

    model, src = _gpt2(tmp_path)
    dst = tmp_path / "out.safetensors"
    report = sparsify_file(str(src), str(dst))
    conv = [f"h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(report.transposed) == sorted(conv) and set(conv) <= set(report.converted)
    assert "read as stored [in, out]" in report.summary()
    got = kp.load_compressed(dst)
    sparse = copy.deepcopy(model)
    kp.sparsify(sparse, progress=False, fuse=False)
    want = sparse.state_dict()
    for prefix in conv:
        for part in ("values", "metadata"):
            assert torch.equal(got[f"{prefix}.{part}"], want[f"{prefix}.{part}"]), (prefix, part)
    expected, _ = sparsify_state_dict(model.state_dict())  # the in-memory path agrees
    assert all(torch.equal(got[name], t) for name, t in expected.items())
    fresh = copy.deepcopy(model)
    kp.sparsify(fresh, progress=False, fuse=False)
    fresh.load_state_dict({k: v for k, v in got.items() if k in want}, strict=False)
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(fresh(ids).last_hidden_state, sparse(ids).last_hidden_state)
    # Said to be as stored, the same weights are pruned along their outputs: another mask, another shape.
    flat = sparsify_file(str(src), str(tmp_path / "flat.safetensors"), transposed="none")
    assert not flat.transposed
    assert kp.load_compressed(tmp_path / "flat.safetensors")["h.0.mlp.c_fc.values"].shape == (64, 128)
    assert got["h.0.mlp.c_fc.values"].shape == (256, 32)


def test_transposed_weights_are_told_by_the_family_or_named():
    from kernelplan.checkpoint import transposed_weights

    gpt2 = ["wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.0.ln_1.weight"]
    assert transposed_weights(gpt2) == {"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight"}
    assert transposed_weights(["transformer." + n for n in gpt2]) == {"transformer.h.0.attn.c_attn.weight",
                                                                    "transformer.h.0.mlp.c_fc.weight"}
    # OpenCLIP's nn.Linear c_fc / c_proj (stored [out, in]) beside token_embedding: not GPT-2's.
    clip = ["token_embedding.weight", "positional_embedding", "transformer.resblocks.0.mlp.c_fc.weight",
            "transformer.resblocks.0.mlp.c_proj.weight"]
    assert transposed_weights(clip) == set()
    assert transposed_weights(gpt2, "none") == set()
    assert transposed_weights(clip, r"mlp\.c_fc") == {"transformer.resblocks.0.mlp.c_fc.weight"}
    with pytest.raises(InvalidProblem, match="neither 'auto', 'none' nor a valid regular expression"):
        transposed_weights(gpt2, "(")


def test_the_command_takes_transposed_for_a_file_only(tmp_path):
    from helpers import kernelplan_cli

    _, src = _gpt2(tmp_path)
    done = kernelplan_cli("sparsify", src, tmp_path / "out.safetensors", "--dry-run")
    assert done.returncode == 0 and "read as stored [in, out]" in done.stdout, done.stderr
    done = kernelplan_cli("sparsify", src, tmp_path / "out.safetensors", "--transposed", "(")
    assert done.returncode == 2 and "neither 'auto', 'none'" in done.stderr
    assert not (tmp_path / "out.safetensors").exists()
    (tmp_path / "dir").mkdir()
    done = kernelplan_cli("sparsify", tmp_path / "dir", tmp_path / "out", "--transposed", "none")
    assert done.returncode == 2 and "--transposed is for a single file" in done.stderr
