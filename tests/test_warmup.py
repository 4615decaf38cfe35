"""``kp.warmup`` and ``kernelplan warmup``: kernels compiled and dispatch settled before the first request."""

from __future__ import annotations

import json

import pytest
import torch

import kernelplan as kp
from helpers import kernelplan_cli


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


@pytest.mark.parametrize("every_n", [True, False])
def test_warmup_compiles_the_rules_kernel_of_every_n_up_to_the_largest_batch_size(monkeypatch, every_n):
    """On the CPU the rule names no kernel to compile, so the rule is stood in for: each shape is asked at every
    point of ``rule_points`` (one n of each run with one tile) and at the batch sizes, once; each distinct kernel is
    compiled once; the rows are the batch sizes'."""
    from kernelplan import warm
    from kernelplan.sparse24.dispatch import rule_points

    asked, built = [], []

    def variant(layer, n):
        asked.append((layer.out_features, layer.in_features, n))
        cfg = f"tile {min(n, 40) // 16}"  # three tiles, as a rule picks fewer tiles than n
        return "cuda_ws", cfg, lambda: built.append((cfg, layer.bias is not None))

    monkeypatch.setattr(warm, "_variant", variant)
    sizes = (1, 100, 16)
    rows = kp.warmup(_model(), batch_sizes=sizes, progress=False, every_n=every_n)
    points = sorted({1, 16, 100} | set(rule_points(100))) if every_n else [1, 16, 100]
    assert asked == [(64, 128, n) for n in points] + [(128, 64, n) for n in points]  # the third layer's shape: asked
    shapes = ((64, 128), (128, 64))
    assert [(r["m"], r["k"], r["n"]) for r in rows] == [(m, k, n) for m, k in shapes for n in (1, 16, 100)]
    tiles = {f"tile {min(n, 40) // 16}" for n in points}
    assert sorted(built) == sorted((t, bias) for t in tiles for bias in (True, False))
    assert {r["compiled"] for r in rows} == {len(built)}


def _run(*args):
    return kernelplan_cli("warmup", *args)


def test_the_warmup_command_reads_shapes_and_refuses_bad_files_in_one_line(tmp_path):
    good, bad = tmp_path / "shapes.json", tmp_path / "bad.json"
    good.write_text(json.dumps([[64, 128], [128, 64]]))
    bad.write_text(json.dumps([[64, "x"]]))
    ok = _run("--shapes", good, "--batch-sizes", "1,16", "--device", "cpu", "--dtype", "f16")
    assert ok.returncode == 0, ok.stderr
    assert "64 x 128" in ok.stdout and ok.stdout.count("reference") == 4
    for args in (("--shapes", bad), ("--shapes", tmp_path / "missing.json"), ("--shapes", good, "--batch-sizes", "a")):
        out = _run(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_after_warmup_no_call_of_those_shapes_compiles_or_tunes(monkeypatch, tmp_path):
    from kernelplan.kernels import nvrtc
    from kernelplan.sparse24 import tuning

    from kernelplan.kernels.gpu_facts import device_facts

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))  # a cold disk cache
    model = _model("cuda", torch.bfloat16)
    # The dispatch rule's device facts, measured once a process by a probe kernel NVRTC compiles (cluster_probe.cu),
    # first wanted inside warmup in a process that has not wanted them yet: not one of the GEMM kernels warmup counts
    # (under xdist, 3 compiles for 2 counted at 5659946, the third with no defines: the probe).
    device_facts(torch.cuda.current_device())
    before = nvrtc.COMPILES[0]
    built = []  # the defines of each kernel NVRTC compiled: what a failure names
    compile_ = nvrtc._compile
    monkeypatch.setattr(nvrtc, "_compile", lambda lib, source, arch: built.append(
        [line for line in source.splitlines() if line.startswith("#define")]) or compile_(lib, source, arch))
    rows = kp.warmup(model, batch_sizes=(1, 16, 128, 300), progress=False)
    assert {r["backend"] for r in rows} <= {"cuda_sp", "cuda_ws"}
    from kernelplan.sparse24.expected import gpus

    if (torch.cuda.get_device_name(), "bf16") in gpus():  # a GPU the sweeps measured: every row has its speedup
        assert all(r["expected"] is not None and r["expected"].graph > 0 for r in rows)
    # The calls of the warm-up compiled nothing the compile phase had not (this process may hold some already).
    assert nvrtc.COMPILES[0] - before <= rows[0]["compiled"], (rows[0]["compiled"], built)
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("a call after warmup tuned"))
    compiles = nvrtc.COMPILES[0]
    with torch.inference_mode():  # the batch sizes, and n between them, which every_n compiled
        for n in (1, 16, 128, 300, 2, 9, 17, 33, 64, 77, 129, 200, 257, 299):
            model(torch.randn(n, 128, device="cuda").to(torch.bfloat16))
    assert nvrtc.COMPILES[0] == compiles, built


def test_the_warmup_command_reads_a_model_directorys_layers_from_its_headers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kernelplan import hf

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_bias=True)
    model = transformers.LlamaForCausalLM(config).eval()
    dense_dir, sparse_dir = tmp_path / "dense", tmp_path / "sparse"
    model.save_pretrained(dense_dir)
    which, layers = hf.layer_shapes(dense_dir)
    # 7 linears a block (q, k, v, o with bias; gate, up, down without), no embeddings, no lm_head.
    assert which == "would prune" and len(layers) == 14
    assert {(x["m"], x["k"], x["bias"]) for x in layers} == {(64, 64, True), (32, 64, True), (128, 64, False),
                                                             (64, 128, False)}
    kp.sparsify(model, progress=False)
    for fmt in hf.FORMATS:
        hf.save_model(model.to(torch.bfloat16), sparse_dir / fmt, fmt)
        which, found = hf.layer_shapes(sparse_dir / fmt)
        assert which == "2:4" and sorted((x["name"], x["m"], x["k"], x["bias"]) for x in found) == sorted(
            (x["name"], x["m"], x["k"], x["bias"]) for x in layers), fmt
        assert {x["dtype"] for x in found} == {torch.bfloat16}
    ok = _run("--model", sparse_dir / "sparse-24-bitmask", "--batch-sizes", "1,16", "--device", "cpu")
    assert ok.returncode == 0, ok.stderr
    assert "14 2:4 layers, 4 distinct shapes" in ok.stdout and ok.stdout.count("reference") == 8
    assert "torch.bfloat16" in ok.stdout  # the checkpoint's dtype, where --dtype is not given
    f16 = _run("--model", dense_dir, "--batch-sizes", "4", "--device", "cpu", "--dtype", "f16")
    assert f16.returncode == 0 and "would prune" in f16.stdout and f16.stdout.count("torch.float16") == 4
    for args in (("--model", tmp_path / "nowhere"), ("--model", dense_dir, "--shapes", "x.json"), ()):
        out = _run(*args)
        assert out.returncode == 2 and out.stderr.strip(), out


def test_the_table_gives_the_sweeps_speedup_exact_or_marked_as_read_from_the_nearest():
    from kernelplan.sparse24.expected import expected, gpus
    from kernelplan.warm import table

    gpu, dtype = gpus()[0]
    doc = json.loads((__import__("pathlib").Path(kp.__file__).parent / "sparse24" / "expected.json").read_text())
    shapes = next(t for t in doc["tables"] if (t["gpu"], t["dtype"]) == (gpu, dtype))["shapes"]
    key, rows = next(iter(shapes.items()))
    m, k = map(int, key.split("x"))
    n, graph, eager = rows[1]
    e = expected(gpu, dtype, m, k, n)
    assert e.basis == "measured" and (e.graph, e.eager) == (graph, eager)
    (n0, g0, _), (n1, g1, _) = rows[1], rows[2]
    mid = expected(gpu, dtype, m, k, round((n0 * n1) ** 0.5))  # halfway in log n
    assert mid.basis == "n interpolated" and min(g0, g1) <= mid.graph <= max(g0, g1)
    near = expected(gpu, dtype, m + 16, k, n)
    assert near.basis == f"nearest {m}x{k}" and near.graph == graph
    assert expected("a GPU never swept", dtype, m, k, n) is None
    text = table([{"m": m + 16, "k": k, "dtype": dtype, "n": n, "backend": "cuda_ws", "config": "-", "expected": near}])
    assert f"~{graph:.2f}x graph" in text and f"[1] nearest {m}x{k}" in text and doc["tables"][0]["sources"][0]["file"] in text
