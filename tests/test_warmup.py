"""``kp.warmup`` and ``kernelplan warmup``: kernels compiled and dispatch settled before the first request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kernelplan as kp


def _model(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 64), torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64)]
    return torch.nn.Sequential(*(kp.nn.Sparse24Linear.from_dense(m.to(device, dtype)) for m in layers))


def test_warmup_lists_each_layer_shape_and_batch_size_once_and_leaves_the_model_as_it_was():
    model = _model()
    x = torch.randn(3, 128)
    before = model(x)
    rows = kp.warmup(model, batch_sizes=(16, 1, 16), progress=False)
    assert [(r["m"], r["k"], r["n"]) for r in rows] == [(64, 128, 1), (64, 128, 16), (128, 64, 1), (128, 64, 16)]
    assert {r["backend"] for r in rows} == {"reference"}  # on CPU the rule's backend; nothing to compile
    assert torch.equal(model(x), before)
    from kernelplan.warm import table

    assert "64 x 128" in table(rows) and "reference" in table(rows)
    with pytest.raises(kp.InvalidProblem, match="batch_sizes"):
        kp.warmup(model, batch_sizes=(0,))
    with pytest.raises(kp.InvalidProblem, match="warmup takes an nn.Module"):
        kp.warmup([model])


def test_the_warmup_command_reads_shapes_and_refuses_bad_files_in_one_line(tmp_path):
    good, bad = tmp_path / "shapes.json", tmp_path / "bad.json"
    good.write_text(json.dumps([[64, 128], [128, 64]]))
    bad.write_text(json.dumps([[64, "x"]]))
    run = lambda *a: subprocess.run([sys.executable, "-m", "kernelplan", "warmup", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    ok = run("--shapes", good, "--batch-sizes", "1,16", "--device", "cpu", "--dtype", "f16")
    assert ok.returncode == 0, ok.stderr
    assert "64 x 128" in ok.stdout and ok.stdout.count("reference") == 4
    for args in (("--shapes", bad), ("--shapes", tmp_path / "missing.json"), ("--shapes", good, "--batch-sizes", "a")):
        out = run(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_after_warmup_no_call_of_those_shapes_compiles_or_tunes(monkeypatch, tmp_path):
    from kernelplan.kernels import nvrtc
    from kernelplan.sparse24 import backends

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    model = _model("cuda", torch.bfloat16)
    before = nvrtc.COMPILES[0]
    rows = kp.warmup(model, batch_sizes=(1, 16, 128, 300), progress=False)
    assert {r["backend"] for r in rows} <= {"cuda_sp", "cuda_ws"}
    # The calls of the warm-up compiled nothing the compile phase had not (this process may hold some already).
    assert nvrtc.COMPILES[0] - before <= len({(r["backend"], r["config"], r["bias"]) for r in rows})
    monkeypatch.setattr(backends, "tune", lambda *a, **k: pytest.fail("a call after warmup tuned"))
    compiles = nvrtc.COMPILES[0]
    with torch.inference_mode():
        for n in (1, 16, 128, 300):
            model(torch.randn(n, 128, device="cuda").to(torch.bfloat16))
    assert nvrtc.COMPILES[0] == compiles
