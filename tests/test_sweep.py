"""``kernelplan bench sparse24 --sweep``: its summary and plot on rows of the sweep's form (the timing runs on a GPU:
``test_sweep_runs_on_the_gpu``)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kernelplan.bench import sweep
from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes


def _rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for (m, k) in list(sweep_shapes())[:5]:
        for n in BATCH_SIZES:
            s = rng.uniform(0.5, 2.0)
            rows.append({"m": m, "k": k, "n": n, "speedup": s, "eager_speedup": s * 0.9, "rule": "cuda_ws",
                         "dense_eager_ms": 0.02, "rule_eager_ms": 0.02 / (s * 0.9)})
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
    rows = sweep.run_sweep(torch.device("cuda"), torch.bfloat16, (1, 37, 300), rep=5, shapes=shapes, log=lambda s: None)
    timed = [r for r in rows if "n" in r]
    assert len(timed) == 6 and not any(k.endswith("_wrong") for r in rows for k in r)
    assert all(r["speedup"] > 0 and r["cuda_ws_err"] <= 2 * r["dense_err"] + 1e-3 for r in timed if r["n"] > 16)
    assert all(r["weight_copies"] == sweep.copies_past_l2(torch.cuda.get_device_properties(0).L2_cache_size,
                                                          r["m"] * r["k"] * 9 // 8, "cold") > 1 for r in timed)
    held = {(r["m"], r["k"]): r["memory"]["ratio"] for r in rows if "memory" in r}
    assert held == {(768, 768): 0.5625, (2304, 768): 0.5625}
    json.dumps(rows)  # the rows go to the JSON file as they are
    sweep.plot(rows, str(tmp_path / "s.png"))


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
