"""``kernelplan bench sparse24 --sweep``: its summary and plot on rows of the sweep's form (the timing runs on a GPU:
``test_sweep_runs_on_the_gpu``)."""

from __future__ import annotations

import copy
import json
import pathlib
import random

import pytest
import torch

from kernelplan.bench import sweep
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.timing import by_short_name


def _rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for (m, k) in list(sweep_shapes())[:5]:
        for n in BATCH_SIZES:
            s = rng.uniform(0.5, 2.0)
            rows.append({"m": m, "k": k, "n": n, "speedup": s, "eager_speedup": s * 0.9, "rule": "cuda_ws",
                         "dense_ms": 0.01, "dense_eager_ms": 0.02, "rule_eager_ms": 0.02 / (s * 0.9),
                         "layers": [f"{m}x{k} layer {i}" for i in range(1 + m % 3)]})
        rows.append({"m": m, "k": k, "memory": {"dense_bytes": 2 * m * k, "held_bytes": 1.125 * m * k,
                                                "ratio": 0.5625}})
    return rows


def test_summary_names_min_median_and_the_worst_rows():
    rows = _rows()
    rows[3]["cuda_ws_wrong"] = True
    lines = sweep.summary(rows, worst=5)
    text = "\n".join(lines)
    timed = [r for r in rows if "speedup" in r]
    small = sorted(r["speedup"] for r in timed if r["n"] <= 16)
    assert f"min {small[0]:.2f}x" in text
    worst = sorted(timed, key=lambda r: r["speedup"])[:5]
    line = next(s for s in lines if s.startswith("worst 5 rows"))
    assert [f"n={r['n']} {r['speedup']:.2f}x" in line for r in worst] == [True] * 5
    assert line.count(";") == 4
    assert "rows with a wrong kernel result: 1" in text
    assert "0.5625-0.5625x of dense" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    sweep.plot(_rows(1), str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sweep_runs_on_the_gpu(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = {(768, 768): ["BERT-base/GPT-2 o"], (2304, 768): ["BERT-base/GPT-2 qkv"]}
    seen = []
    rows = sweep.run_sweep(torch.device("cuda"), torch.bfloat16, (1, 37, 300), rep=5, shapes=shapes, log=lambda s: None,
                           done=lambda so_far: seen.append(len(so_far)))
    assert seen == [4, 8]  # after each shape: its 3 timed rows and its bytes held
    timed = [r for r in rows if "n" in r]
    assert len(timed) == 6 and not any(k.endswith("_wrong") for r in rows for k in r)
    assert all(r["speedup"] > 0 and r["cuda_ws_err"] <= 2 * r["dense_err"] + 1e-3 for r in timed if r["n"] > 16)
    assert all(r["weight_copies"] == sweep.copies_past_l2(torch.cuda.get_device_properties(0).L2_cache_size,
                                                          r["m"] * r["k"] * 9 // 8, "cold") > 1 for r in timed)
    held = {(r["m"], r["k"]): r["memory"]["ratio"] for r in rows if "memory" in r}
    assert held == {(768, 768): 0.5625, (2304, 768): 0.5625}
    json.dumps(rows)  # the rows go to the JSON file as they are
    sweep.plot(rows, str(tmp_path / "s.png"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_command_sweeps_given_shapes_on_the_gpu(tmp_path, monkeypatch, capsys):
    """``--shapes``: a layer the device layout holds, one of odd M it holds padded, and one of K = 200 it holds
    padded to 256 (0083), each right against fp64 at every n (the sweep marks a wrong result), with its bytes held;
    one of K = 204, which the 2:4 format cannot hold, left out and said so."""
    pytest.importorskip("matplotlib")
    from kernelplan import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text(json.dumps([[512, 1024], [200, 512], [96, 200], [96, 204]]))
    assert cli.main(["bench", "sparse24", "--sweep", "--shapes", "s.json", "--batch", "1", "40",
                     "--json", "given.json"]) == 0
    doc = json.loads((tmp_path / "given.json").read_text())
    timed = [r for r in doc["rows"] if "n" in r]
    assert sorted((r["m"], r["k"], r["n"]) for r in timed) == [(96, 200, 1), (96, 200, 40), (200, 512, 1),
                                                             (200, 512, 40), (512, 1024, 1), (512, 1024, 40)]
    assert not any(k.endswith("_wrong") for r in doc["rows"] for k in r) and all(r["speedup"] > 0 for r in timed)
    held = {(r["m"], r["k"]): r["memory"]["ratio"] for r in doc["rows"] if "memory" in r}
    assert set(held) == {(512, 1024), (200, 512), (96, 200)} and held[(512, 1024)] == 0.5625
    assert held[(96, 200)] == 0.5625 * 256 / 200  # the padding's columns held too
    assert [(x["m"], x["k"]) for x in doc["skipped"]] == [(96, 204)]
    assert doc["shape_set"] == "given" and doc["shapes_from"] == "--shapes s.json"
    capsys.readouterr()


def test_cold_l2_rotates_copies_past_twice_the_l2():
    assert sweep.copies_past_l2(50 << 20, 1 << 20, "cold") == 100  # 100 copies of 1 MiB: twice 50 MiB
    assert sweep.copies_past_l2(50 << 20, 30 << 20, "cold") == 4
    assert sweep.copies_past_l2(50 << 20, 500 << 20, "cold") == 1  # past the L2 on its own
    assert sweep.copies_past_l2(50 << 20, 1024, "cold") == sweep.MAX_COPIES
    assert sweep.copies_past_l2(50 << 20, 1 << 20, "warm") == 1
    with pytest.raises(ValueError, match="l2='hot'"):
        sweep.copies_past_l2(50 << 20, 1 << 20, "hot")


def test_cycling_calls_each_in_turn():
    seen = []
    call = sweep._cycling([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2] + [0, 1, 2, 0, 1, 2, 0]  # each once eagerly first, then in turn


def test_kernel_times_by_cut_names_sum_the_kernels_whose_cut_names_meet():
    """Inductor's kernel names start alike: cut to 20 characters, two of them share a key, and both times count."""
    ms = {"triton_poi_fused_add_cat_0": 0.5, "triton_poi_fused_add_cat_1": 0.25, "kp_sparse24_ws": 0.125}
    assert by_short_name(ms, 20) == {"triton_poi_fused_add": 0.75, "kp_sparse24_ws": 0.125}
    assert by_short_name(ms, 100) == ms


def _part(rows, sizes, date, **meta):
    """The JSON a sweep run over ``sizes`` writes, from rows of the sweep's form (each shape's memory row too)."""
    doc = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "commit": "abc1234", "date": date,
           "dtype": "bf16", "l2": "cold", "timing": "t", "l2_means": "m", "batch_sizes": sorted(set(sizes))}
    doc.update(meta)
    doc["rows"] = copy.deepcopy([r for r in rows if "n" not in r or r["n"] in sizes])
    return doc


def test_merge_joins_parts_over_disjoint_batch_sizes_into_the_whole_sweep():
    rows = _rows()
    low, high = [n for n in BATCH_SIZES if n < 512], [n for n in BATCH_SIZES if n >= 512]
    a, b = _part(rows, high, "2026-11-27T09:00:00+00:00"), _part(rows, low, "2026-11-27T08:00:00+00:00")
    shape = (a["rows"][-1]["m"], a["rows"][-1]["k"])
    b["rows"][-1]["memory"]["held_bytes"] += 64  # a later call derived something: the larger count stands
    merged = sweep.merge([("a.json", a), ("b.json", b)])
    assert merged["batch_sizes"] == sorted(BATCH_SIZES)
    assert merged["date"] == "2026-11-27T09:00:00+00:00"
    assert merged["parts"] == [{"file": "a.json", "date": a["date"], "batch_sizes": high},
                               {"file": "b.json", "date": b["date"], "batch_sizes": low}]
    assert merged["commit"] == "abc1234" and merged["timing"] == "t"
    timed = [r for r in merged["rows"] if "n" in r]
    assert [(r["m"], r["k"], r["n"]) for r in timed] == [(r["m"], r["k"], r["n"]) for r in rows if "n" in r]
    held = {(r["m"], r["k"]): r["memory"]["held_bytes"] for r in merged["rows"] if "memory" in r}
    assert held[shape] == b["rows"][-1]["memory"]["held_bytes"] and len(held) == 5
    assert "memory" in merged["rows"][len(BATCH_SIZES)]  # each shape's timed rows, then its memory row
    assert sweep.summary(merged["rows"]) == sweep.summary(rows)


@pytest.mark.parametrize("key, value", [("commit", "def5678"), ("device", "NVIDIA H100 80GB HBM3"), ("dtype", "f16"),
                                        ("l2", "warm"), ("shape_set", "lm heads")])
def test_merge_refuses_parts_of_two_sweeps(key, value):
    rows = _rows()
    a, b = _part(rows, [1, 8], "d1"), _part(rows, [16], "d2", **{key: value})
    with pytest.raises(ValueError, match=f"b.json has {key} {value!r} but a.json has"):
        sweep.merge([("a.json", a), ("b.json", b)])


def test_merge_refuses_a_problem_timed_twice_and_a_single_part():
    rows = _rows()
    a, b = _part(rows, [1, 8], "d1"), _part(rows, [8, 16], "d2")
    with pytest.raises(ValueError, match="b.json and a.json both time .* at n = 8"):
        sweep.merge([("a.json", a), ("b.json", b)])
    with pytest.raises(ValueError, match="two or more"):
        sweep.merge([("a.json", a)])


def test_the_merge_command_writes_one_sweep_without_a_gpu(tmp_path, capsys):
    from kernelplan import cli

    rows = _rows()
    paths = []
    for name, sizes in (("hi.json", [n for n in BATCH_SIZES if n >= 64]), ("lo.json", [1, 8, 16, 32])):
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_text(json.dumps(_part(rows, sizes, name)))
    out = tmp_path / "whole.json"
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", *paths, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["batch_sizes"] == sorted(BATCH_SIZES) and len(doc["parts"]) == 2
    assert "wrote" in capsys.readouterr().out
    (tmp_path / "lo.json").write_text("{")  # a part cut short
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", *paths, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kernelplan bench --merge: {paths[1]} could not be read") and err.count("\n") == 1
    (tmp_path / "lo.json").write_text(json.dumps({"device": "NVIDIA H200"}))  # some other JSON
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", *paths, "--json", str(out)]) == 2
    assert f"{paths[1]} has no 'rows'" in capsys.readouterr().err
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", paths[0], str(tmp_path / "gone.json")]) == 2
    assert "gone.json could not be read" in capsys.readouterr().err


def test_sweep_parts_written_by_the_command_merge_into_the_whole(tmp_path, monkeypatch, capsys):
    """``run_sweep_command`` with ``batch`` (the timing stubbed: it runs on a GPU) writes a part that --merge
    joins."""
    from kernelplan import bench, cli

    rows = _rows()
    asked = []

    def fake_run_sweep(dev, dtype, sizes, shapes, log, l2, done):
        assert shapes == sweep_shapes()
        asked.append(tuple(sizes))
        return copy.deepcopy([r for r in rows if "n" not in r or r["n"] in sizes])

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    monkeypatch.setenv("KERNELPLAN_COMMIT", "abc1234")
    parts = [str(tmp_path / "lo.json"), str(tmp_path / "hi.json")]
    assert bench.run_sweep_command(None, "bf16", False, parts[0], batch=[1, 8, 16, 32, 64]) == 0
    assert bench.run_sweep_command(None, "bf16", False, parts[1], batch=[128, 256, 512, 1024, 2048, 4096, 8192]) == 0
    assert asked == [(1, 8, 16, 32, 64), (128, 256, 512, 1024, 2048, 4096, 8192)]
    part = json.loads(open(parts[0]).read())
    assert part["batch_sizes"] == [1, 8, 16, 32, 64] and part["device"] == "NVIDIA H200" and part["l2"] == "cold"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", *parts]) == 0
    whole = json.loads((tmp_path / "sparse24-sweep-h200.json").read_text())
    assert whole["batch_sizes"] == sorted(BATCH_SIZES)
    assert sweep.summary(whole["rows"]) == sweep.summary(rows)
    capsys.readouterr()


def test_the_lm_heads_sweep_times_the_heads_and_is_named_and_merged_as_its_own(tmp_path, monkeypatch, capsys):
    """``--lm-heads`` (the timing stubbed): run_sweep gets the heads, the JSON says its shape set and takes its own
    default name, and its parts merge into an LM-heads sweep, not the sweep set's."""
    from kernelplan import bench, cli
    from kernelplan.bench.shapes import lm_head_shapes

    rows, asked = _rows(), []

    def fake_run_sweep(dev, dtype, sizes, shapes, log, l2, done):
        asked.append(shapes)
        return copy.deepcopy([r for r in rows if "n" not in r or r["n"] in sizes])

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    monkeypatch.setenv("KERNELPLAN_COMMIT", "abc1234")
    monkeypatch.chdir(tmp_path)
    assert bench.run_sweep_command(None, "bf16", False, None, batch=[1, 8], shape_set="lm heads") == 0
    assert asked == [lm_head_shapes()]
    part = json.loads((tmp_path / "sparse24-sweep-lm-heads-h200.json").read_text())
    assert part["shape_set"] == "lm heads" and part["batch_sizes"] == [1, 8]
    (tmp_path / "lo.json").write_text(json.dumps(part))
    assert bench.run_sweep_command(None, "bf16", False, str(tmp_path / "hi.json"), batch=[16],
                                   shape_set="lm heads") == 0
    (tmp_path / "sparse24-sweep-lm-heads-h200.json").unlink()
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", "lo.json", "hi.json"]) == 0
    whole = json.loads((tmp_path / "sparse24-sweep-lm-heads-h200.json").read_text())
    assert whole["shape_set"] == "lm heads" and whole["batch_sizes"] == [1, 8, 16]
    assert not (tmp_path / "sparse24-sweep-h200.json").exists()
    assert sweep.default_name("NVIDIA H100 80GB HBM3", "f16", "warm", "lm heads") == \
        "sparse24-sweep-lm-heads-h100-f16-l2warm"
    capsys.readouterr()


def test_held_out_shapes_are_other_models_projections_outside_the_sweep_set_and_the_heads():
    from kernelplan.bench.shapes import HELD_OUT_MODELS, MODELS, held_out_shapes, lm_head_shapes

    held = held_out_shapes()
    assert held[(1152, 896)] == ["Qwen2.5-0.5B qkv"]  # 14 heads of 64 and 2 KV heads: 896 + 2 x 128 rows
    assert held[(2048, 2048)] == ["Qwen2.5-3B o", "Llama-3.2-1B o", "TinyLlama-1.1B o"]
    assert held[(6400, 1600)] == ["GPT-2-XL gate_up"]  # not gated: one up projection of 4 x hidden
    assert not set(held) & (set(sweep_shapes()) | set(lm_head_shapes()))
    assert not {m.name for m in HELD_OUT_MODELS} & {m.name for m in MODELS}
    every = {s for m in HELD_OUT_MODELS for s in m.layers().values()}
    assert set(held) == every - set(sweep_shapes())
    assert (3072, 3072) in every - set(held)  # Llama-3.2-3B's o is Phi-3-mini's, in the sweep set


def _fake_gpu_sweep(monkeypatch, tmp_path) -> list:
    """The sweep's timing stubbed on a 'GPU': run_sweep records the shapes it is asked for."""
    asked = []

    def fake_run_sweep(dev, dtype, sizes, shapes, log, l2, done):
        asked.append(shapes)
        return copy.deepcopy([r for r in _rows() if "n" not in r or r["n"] in sizes])

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    monkeypatch.setenv("KERNELPLAN_COMMIT", "abc1234")
    monkeypatch.chdir(tmp_path)
    return asked


def test_the_cli_sweeps_the_held_out_models_under_their_own_name(tmp_path, monkeypatch, capsys):
    from kernelplan import cli
    from kernelplan.bench.shapes import held_out_shapes

    asked = _fake_gpu_sweep(monkeypatch, tmp_path)
    assert cli.main(["bench", "sparse24", "--sweep", "--held-out", "--batch", "8"]) == 0
    assert asked == [held_out_shapes()]
    assert json.loads((tmp_path / "sparse24-sweep-held-out-models-h200.json").read_text())["shape_set"] == \
        "held-out models"
    capsys.readouterr()


def test_the_cli_sweeps_a_users_shapes_and_model_under_the_given_name(tmp_path, monkeypatch, capsys):
    """``--shapes FILE`` and ``--model DIR``: the sweep times those layers, each distinct (M, K) once with the names
    of its layers, and the JSON says where they came from; merge keeps parts of other shapes apart."""
    from kernelplan import cli

    asked = _fake_gpu_sweep(monkeypatch, tmp_path)
    given = tmp_path / "shapes.json"
    given.write_text(json.dumps([[4096, 1600], [1600, 4096], [4096, 1600], [64, 204], [64, 200]]))
    assert cli.main(["bench", "sparse24", "--sweep", "--shapes", str(given), "--batch", "8"]) == 0
    # K = 200 is held padded (0083) and swept; K = 204 is not a multiple of 8, the 2:4 format's.
    assert asked == [{(4096, 1600): ["4096x1600"], (1600, 4096): ["1600x4096"], (64, 200): ["64x200"]}]
    assert "left out 64x204 (64x204): K = 204 is not a multiple of 8" in capsys.readouterr().err
    doc = json.loads((tmp_path / "sparse24-sweep-given-h200.json").read_text())
    assert doc["shape_set"] == "given" and doc["shapes_from"] == f"--shapes {given}"
    assert doc["together"] == sweep.together(doc["rows"]) and doc["together"][1].startswith("  n = 8: ")
    assert [(x["m"], x["k"], x["layers"]) for x in doc["skipped"]] == [(64, 204, ["64x204"])]
    assert sweep.default_name("NVIDIA H100 80GB HBM3", "f16", "cold", "given") == "sparse24-sweep-given-h100-f16"

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    assert cli.main(["bench", "sparse24", "--sweep", "--model", str(tmp_path / "llama"), "--batch", "16",
                     "--json", str(tmp_path / "llama.json")]) == 0
    layers = asked[-1]
    assert sorted(layers) == [(32, 64), (64, 64), (64, 128), (128, 64)]  # k and v, q and o, down, gate and up
    assert sorted(layers[(64, 64)]) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "q_proj")]
    assert json.loads((tmp_path / "llama.json").read_text())["shapes_from"] == f"--model {tmp_path / 'llama'}"
    capsys.readouterr()
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", str(tmp_path / "llama.json"),
                     str(tmp_path / "sparse24-sweep-given-h200.json")]) == 2
    assert "shapes_from" in capsys.readouterr().err


def test_given_layers_together_weigh_each_shape_by_its_layers():
    """sweep.together: at each n, dense's summed time over the rule's, a shape counted once for each layer with it;
    the bytes likewise; an n where a shape has no time is named, not summed."""
    def row(m, n, dense, speedup, layers):
        return {"m": m, "k": 64, "n": n, "dense_ms": dense, "speedup": speedup, "dense_eager_ms": 2 * dense,
                "rule_eager_ms": 2 * dense / speedup * 1.25, "layers": [f"l{i}" for i in range(layers)]}

    wrong = {"m": 256, "k": 64, "n": 8, "dense_ms": 3.0, "layers": ["l0"], "cuda_ws_wrong": True}
    rows = [row(128, 1, 1.0, 2.0, 2), row(128, 8, 1.0, 1.0, 2),
            {"m": 128, "k": 64, "memory": {"dense_bytes": 100, "held_bytes": 56}},
            row(256, 1, 3.0, 1.0, 1), wrong, {"m": 256, "k": 64, "memory": {"dense_bytes": 300, "held_bytes": 150}}]
    lines = sweep.together(rows)
    # n = 1: dense 2 x 1 + 3 = 5 ms, the rule's 2 x 0.5 + 3 = 4 ms; eager each 1.25x longer
    assert lines[1] == "  n = 1: 1.25x graph, 1.00x eager"
    assert lines[2] == "  n = 8: incomplete, no time of the rule's kernel on 256x64"
    assert lines[3].endswith(f"dense {500 / 2**20:.1f} MiB ({(2 * 56 + 150) / 500:.4f}x)")


def test_the_cli_refuses_given_shapes_it_cannot_sweep_before_any_timing(tmp_path, monkeypatch, capsys):
    """A bad --shapes file, no layer a 2:4 GPU kernel runs, a missing model directory, and --model or --shapes beside
    another choice of shapes or without --sweep: exit 2 with a line naming it (and one a layer left out), and
    run_sweep never asked."""
    from kernelplan import cli

    asked = _fake_gpu_sweep(monkeypatch, tmp_path)
    (tmp_path / "odd.json").write_text(json.dumps([[64, 100]]))
    (tmp_path / "bad.json").write_text(json.dumps([[4096, "1600"]]))
    cases = [
        (["--sweep", "--shapes", "odd.json"], "no layer left to sweep"),
        (["--sweep", "--shapes", "bad.json"], "JSON list of [M, K] pairs of positive integers"),
        (["--sweep", "--shapes", "missing.json"], "--shapes missing.json"),
        (["--sweep", "--model", "nowhere"], "--model nowhere"),
        (["--sweep", "--shapes", "odd.json", "--held-out"], "--held-out and --shapes each choose the shapes"),
        (["--sweep", "--model", "x", "--shapes", "odd.json"], "--model and --shapes each choose the shapes"),
        (["--shapes", "odd.json"], "belong to --sweep"),
        (["--sweep", "--merge", "a.json", "b.json", "--model", "x"], "leave out"),
    ]
    for args, says in cases:
        assert cli.main(["bench", "sparse24", *args]) == 2, args
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == (2 if "left to sweep" in says else 1), (args, err)
    assert asked == [] and not list(tmp_path.glob("sparse24-sweep-*"))


def test_lm_heads_are_the_sweep_models_vocabularies_by_their_hidden_size_and_not_in_the_sweep_set():
    from kernelplan.bench.shapes import MODELS, lm_head_shapes

    heads = lm_head_shapes()
    assert heads[(152064, 3584)] == ["Qwen2.5-7B lm_head"]
    assert heads[(128256, 4096)] == ["Llama-3-8B lm_head"] and (32000, 4096) in heads  # Mistral-7B's sizes
    assert {(v, m.hidden) for m in MODELS for v in m.vocabs} == set(heads)
    assert all(m.vocabs for m in MODELS)
    assert not set(heads) & set(sweep_shapes())


def test_the_model_bench_builds_each_family_at_its_sweep_set_sizes():
    """bench/sparse24_model.py --model: each family's class at shapes.MODELS' sizes, so its layers, grouped as
    kp.sparsify groups them (q/k/v, gate/up), are sweep-set shapes and its head an LM head of lm_head_shapes."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    from kernelplan.bench.shapes import lm_head_shapes

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import sparse24_model

    assert len({family for family, _, _ in sparse24_model.ARCHITECTURES.values()}) >= 4
    for name in sparse24_model.ARCHITECTURES:
        with torch.device("meta"):
            model = sparse24_model.build_model(name, 1)
        shape = {n.rsplit(".", 1)[-1]: tuple(mod.weight.shape) for n, mod in model.named_modules()
                 if isinstance(mod, torch.nn.Linear)}
        qkv = shape.get("qkv_proj") or (sum(shape[p][0] for p in ("q_proj", "k_proj", "v_proj")), shape["q_proj"][1])
        gate_up = shape.get("gate_up_proj") or (shape["gate_proj"][0] + shape["up_proj"][0], shape["up_proj"][1])
        for layer in (qkv, gate_up, shape["o_proj"], shape["down_proj"]):
            assert layer in sweep_shapes(), (name, layer)
        assert shape["lm_head"] in lm_head_shapes(), name


def test_a_sweep_cut_short_keeps_its_shapes_timed_and_merge_refuses_it(tmp_path, monkeypatch, capsys):
    """After each shape the command writes ``<json>.partial``: a run stopped by its time limit keeps those rows, marked
    cut short, which --merge refuses; a run that ends writes the sweep and removes the partial file."""
    from kernelplan import bench, cli

    rows = _rows()
    shapes = list(sweep_shapes())

    def stopped_run_sweep(dev, dtype, sizes, shapes, log, l2, done):
        first = [r for r in rows if (r["m"], r["k"]) == next(iter(shapes)) and ("n" not in r or r["n"] in sizes)]
        done(copy.deepcopy(first))
        raise KeyboardInterrupt  # what a time limit's signal does to the run

    monkeypatch.setattr(sweep, "run_sweep", stopped_run_sweep)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    monkeypatch.setenv("KERNELPLAN_COMMIT", "abc1234")
    out = tmp_path / "part.json"
    with pytest.raises(KeyboardInterrupt):
        bench.run_sweep_command(None, "bf16", False, str(out), batch=[1, 8])
    assert not out.exists()
    kept = json.loads((tmp_path / "part.json.partial").read_text())
    assert kept["cut_short"] == f"1 of {len(shapes)} shapes timed at n = 1, 8"
    assert {(r["m"], r["k"]) for r in kept["rows"]} == {shapes[0]} and kept["batch_sizes"] == [1, 8]
    (tmp_path / "whole.json").write_text(json.dumps(kept | {"cut_short": None, "batch_sizes": [16]}))
    assert cli.main(["bench", "sparse24", "--sweep", "--merge", str(tmp_path / "part.json.partial"),
                     str(tmp_path / "whole.json")]) == 2
    assert "ended early (1 of" in capsys.readouterr().err

    def full_run_sweep(dev, dtype, sizes, shapes, log, l2, done):
        done([])
        return copy.deepcopy([r for r in rows if "n" not in r or r["n"] in sizes])

    monkeypatch.setattr(sweep, "run_sweep", full_run_sweep)
    assert bench.run_sweep_command(None, "bf16", False, str(out), batch=[1, 8]) == 0
    assert out.exists() and not (tmp_path / "part.json.partial").exists()
    capsys.readouterr()


def test_the_model_host_bench_runs_a_tiny_model_on_the_cpu(capsys):
    """bench/sparse24_model_host.py --tiny --device cpu: its smoke test (the numbers it means are a GPU's)."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import sparse24_model_host

    assert sparse24_model_host.main(["--model", "phi-3-mini", "--tiny", "--device", "cpu", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for case in ("decode batch 1", "decode batch 128", "prefill 512"):
        assert f"{case}: host ms a step, dense " in out


def test_results_record_the_gpus_attributes_and_never_fail_on_them(tmp_path, monkeypatch):
    """Every results file's metadata carries its GPU's driver attributes (what tells an H100 from an H200 of the same
    SM count, docs/design/0054); where the driver cannot give them it says why, and the file is still written."""
    from kernelplan.bench import results
    from kernelplan.kernels import gpu_facts, nvrtc

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    values = {"MULTIPROCESSOR_COUNT": 132, "L2_CACHE_SIZE": 50 << 20, "MEMORY_CLOCK_RATE": 3_201_000,
              "GLOBAL_MEMORY_BUS_WIDTH": 6144, "CLOCK_RATE": 1_980_000, "COMPUTE_CAPABILITY_MAJOR": 8}
    monkeypatch.setattr(nvrtc, "device_attribute", lambda index, name: values[name])
    meta = json.loads(pathlib.Path(results.write("x", {"rows": []}, str(tmp_path / "a.json"), dtype="bf16"))
                      .read_text())["meta"]
    assert meta["device"] == "NVIDIA H200" and meta["dtype"] == "bf16"
    assert meta["gpu"] == {"sms": 132, "l2_bytes": 50 << 20, "memory_clock_khz": 3_201_000, "memory_bus_bits": 6144,
                           "clock_khz": 1_980_000}

    values["COMPUTE_CAPABILITY_MAJOR"] = 9  # Hopper: the clusters the tile rule counts, the driver's
    monkeypatch.setattr(gpu_facts, "device_facts", lambda index: gpu_facts.GpuFacts.model(132))
    assert results.gpu_attributes(0)["rule_facts"]["ctas"]["3"]["1"] == 117

    def no_probe(index):
        raise nvrtc.KernelPlanError("cuOccupancyMaxActiveClusters failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(gpu_facts, "device_facts", no_probe)
    assert results.gpu_attributes(0) == {**meta["gpu"], "rule_facts": "unreadable: KernelPlanError: "
                                         "cuOccupancyMaxActiveClusters failed: CUDA_ERROR_INVALID_VALUE"}

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(nvrtc, "device_attribute", lambda index, name: index)
    assert set(results.gpu_attributes(None).values()) == {3}  # None: the current device

    def unreadable(index, name):
        raise nvrtc.KernelPlanError(f"cannot read cuda:{index}'s {name.lower()}: CUDA_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(nvrtc, "device_attribute", unreadable)
    meta = json.loads(pathlib.Path(results.write("x", {"rows": [1]}, str(tmp_path / "b.json"))).read_text())["meta"]
    assert meta["gpu"] == {"unreadable": "KernelPlanError: cannot read cuda:0's multiprocessor_count: "
                                         "CUDA_ERROR_NOT_INITIALIZED"}


def test_a_sweeps_environment_records_its_gpus_attributes(monkeypatch):
    """The sweeps' and the main bench's metadata (bench.environment) carries the GPU's attributes too; a CPU run's
    has none."""
    from kernelplan import bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H200")
    monkeypatch.setattr(bench, "gpu_attributes", lambda index: {"sms": 132, "asked": index})
    assert bench.environment(torch.device("cuda", 1))["gpu"] == {"sms": 132, "asked": 1}
    assert bench.environment(torch.device("cuda"))["gpu"] == {"sms": 132, "asked": None}  # the current device
    assert "gpu" not in bench.environment(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpus_attributes_are_the_drivers():
    from kernelplan.bench import results

    props = torch.cuda.get_device_properties(0)
    got = results.gpu_attributes(0)
    assert got["sms"] == props.multi_processor_count and got["l2_bytes"] == props.L2_cache_size
    assert got["memory_clock_khz"] > 1e5 and got["memory_bus_bits"] >= 64 and got["clock_khz"] > 1e5


def test_a_device_attribute_is_the_drivers_reading_of_that_attribute(monkeypatch):
    """nvrtc.device_attribute (shared_per_block's and the results' reader) asks the driver for the named attribute of
    the device's handle, and names the attribute and the driver's error where it cannot."""
    from cuda.bindings import driver as cu

    from kernelplan.kernels import nvrtc

    asked = []
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cu, "cuDeviceGet", lambda index: (cu.CUresult.CUDA_SUCCESS, f"dev{index}"))
    monkeypatch.setattr(cu, "cuDeviceGetAttribute", lambda attr, dev: asked.append((attr, dev)) or
                        (cu.CUresult.CUDA_SUCCESS, 232448))
    nvrtc.shared_per_block.cache_clear()
    assert nvrtc.shared_per_block(1) == 232448
    assert asked == [(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "dev1")]
    monkeypatch.setattr(cu, "cuDeviceGet", lambda index: (cu.CUresult.CUDA_ERROR_INVALID_DEVICE, None))
    with pytest.raises(nvrtc.KernelPlanError, match="cuda:3's l2_cache_size: CUDA_ERROR_INVALID_DEVICE"):
        nvrtc.device_attribute(3, "L2_CACHE_SIZE")
    nvrtc.shared_per_block.cache_clear()


def test_a_sweeps_summary_says_what_the_tile_rule_read_of_its_gpu(tmp_path, capsys, monkeypatch):
    """The sweep's printout names the GPU facts the rule read (docs/design/0065, 0066), from its file's gpu record;
    a file without them (before 0065) prints none, one whose facts were unreadable says so."""
    from kernelplan.bench import _write_sweep, sweep
    from kernelplan.bench.sweep import facts_line
    from kernelplan.kernels.gpu_facts import GpuFacts

    monkeypatch.setattr(sweep, "plot", lambda *args: None)  # no rows to plot

    gpu = {"sms": 132, "rule_facts": GpuFacts.model(132).to_json()}
    assert facts_line(gpu) == ("the tile rule's GPU facts (model): 132 SMs; clusters of 2/3/4/8 CTAs place "
                               "132/117/120/120 CTAs at once, one an SM; DRAM 4.81 TB/s")
    assert facts_line({"sms": 132}) is None
    assert facts_line({"rule_facts": "unreadable: KeyError"}) == "the tile rule's GPU facts: unreadable: KeyError"
    doc = {"rows": [], "gpu": gpu, "dtype": "bf16", "l2": "cold", "device": "NVIDIA H200", "commit": "x"}
    _write_sweep(doc, str(tmp_path / "s.json"))
    assert "the tile rule's GPU facts (model)" in capsys.readouterr().out


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
def test_the_sweep_precompiles_cuda_ws_only_where_the_dispatch_runs_it(monkeypatch, capability):
    """On Ampere and Ada the dispatch runs cuda_sp alone: the sweep compiles no sm_90a kernel there, whose module
    would not load; on Hopper every cuda_ws tile it will run past n = 16, the device's rule's."""
    from kernelplan.bench import sweep
    from kernelplan.kernels import gpu_facts, sparse24_ws, sparse24_ws_rule
    from kernelplan.sparse24.dispatch import backend_for

    compiled = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(sparse24_ws, "sm_count", lambda index: 132)
    monkeypatch.setattr(sparse24_ws, "device_facts", lambda index: gpu_facts.GpuFacts.model(132))
    monkeypatch.setattr(sparse24_ws, "_launcher", lambda cfg, *args: compiled.append(cfg))
    shapes, batch = [(4096, 4096), (28672, 4096)], [1, 16, 32, 512]
    sweep._precompile(shapes, batch, "bf16", 0)
    want = {sparse24_ws_rule.ws_config(n, m, k, 132) for m, k in shapes for n in batch
            if n > 16 and backend_for(capability, n, m, k, "bf16") == "cuda_ws"}
    assert sorted(map(str, compiled)) == sorted(map(str, want)) and bool(want) == (capability == (9, 0))


@pytest.mark.parametrize("capability, names", [((8, 0), ["cuda_sp"]), ((8, 9), ["cuda_sp"]),
                                               ((9, 0), ["cuda_sp", "cuda_ws"])])
def test_the_sweep_times_cuda_ws_only_on_hopper(capability, names):
    """cuda_ws is sm_90a's (wgmma.sp, TMA, clusters): on Ampere and Ada the sweep times cuda_sp, the dispatch's kernel
    there, rather than fail loading an sm_90a module."""
    from kernelplan.bench import sweep

    assert sorted(sweep._kernels(capability)) == names
