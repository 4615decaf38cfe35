"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    exec(compile(code, str(README), "exec"), {})


def test_readme_has_exactly_two_setup_commands():
    # The set-up commands are the bash blocks; the install lines are plain blocks.
    bash = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    setup = [b for b in bash if "pip install" in b]
    assert len(setup) == 2 and "kernelplan bench" in setup[0] and "pytest" in setup[1]


def test_readme_performance_table_is_generated_from_the_results():
    """The table is tools/readme_table.py's output over bench/results/*.json: rerun it after a bench."""
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import readme_table

    assert readme_table.readme_block(README.read_text()) == readme_table.table(), (
        "README's performance table differs from bench/results/*.json: run python tools/readme_table.py")


def test_readme_table_changes_with_the_results(tmp_path, monkeypatch):
    """The check can fail: a results file with other numbers gives another table."""
    import json
    import shutil
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import readme_table

    before = readme_table.table()
    results = tmp_path / "results"
    shutil.copytree(readme_table.RESULTS, results)
    doc = json.loads((results / "sparse24-h200.json").read_text())
    for row in doc["suites"]["sparse24"]:
        if "speedup" in row:
            row["speedup"] *= 0.5
    (results / "sparse24-h200.json").write_text(json.dumps(doc))
    monkeypatch.setattr(readme_table, "RESULTS", results)
    assert readme_table.table() != before


def test_the_shipped_expected_speedups_are_the_tools_digest_of_the_results():
    """src/kernelplan/sparse24/expected.json is tools/expected_table.py's output: rerun it after a sweep."""
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import expected_table

    assert expected_table.OUT.read_text() == expected_table.text(), (
        "expected.json differs from bench/results/sparse24-sweep-*.json: run python tools/expected_table.py")


def test_each_cell_keeps_its_newest_reading_over_the_sweeps_of_one_l2_regime(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import expected_table

    from kernelplan.sparse24.expected import source

    def sweep(name, date, ns, speedup, l2="cold"):
        rows = [{"m": 64, "k": 128, "n": n, "speedup": speedup, "eager_speedup": speedup / 2} for n in ns]
        doc = {"device": "G", "dtype": "bf16", "l2": l2, "date": date, "commit": name[:3], "batch_sizes": ns,
               "rows": rows + [{"m": 64, "k": 128, "memory": {}}]}
        (tmp_path / f"sparse24-sweep-{name}.json").write_text(json.dumps(doc))

    sweep("base", "2026-01-02", [1, 8, 16, 32, 64], 1.5)
    sweep("new", "2026-01-03", [1, 8], 1.7)  # run again after a rule changed
    sweep("old", "2026-01-01", [16, 128], 9.0)  # older than the base: its n = 16 is the base's, its n = 128 its own
    sweep("warm", "2026-01-04", [32], 9.0, l2="warm")  # another L2 regime: not taken
    table, = expected_table.tables(tmp_path)["tables"]
    assert table["shapes"]["64x128"] == [[1, 1.7, 0.85], [8, 1.7, 0.85], [16, 1.5, 0.75], [32, 1.5, 0.75],
                                         [64, 1.5, 0.75], [128, 9.0, 4.5]]
    assert source(table) == ("sparse24-sweep-old.json at old (n = 128); sparse24-sweep-base.json at bas (n = 16, 32, "
                             "64); sparse24-sweep-new.json at new (n = 1, 8), L2 cold")


def test_ab_table_groups_a_committed_probe_run_by_tile():
    """tools/ab_table.py, over the committed local-sync A/B (docs/design/0049's table): the cluster's first sync
    against the CTA's own on the 26 problems of K over 2 CTAs and 16 MB or more, and the ping-pong control."""
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import json

    import ab_table

    doc = json.loads((README.parent / "bench" / "results" / "sparse24-local-sync-h100.json").read_text())
    got = {(k, v): (n, gm) for k, v, n, gm, lo, hi in ab_table.table(doc["rows"], "full_KP_EARLY_FILL=0")}
    n, gm = got[("cm 1 x kc 2, >= 16 MB", "full_KP_EARLY_FILL=0,KP_LOCAL_SYNC=0")]
    assert n == 26 and gm == pytest.approx(1.034, abs=5e-4)
    n, gm = got[("ping-pong", "full_KP_EARLY_FILL=0,KP_LOCAL_SYNC=0")]
    assert n == 11 and gm == pytest.approx(0.999, abs=5e-4)


def test_an_lm_heads_sweep_adds_its_shapes_and_is_never_the_base(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import expected_table

    def sweep(name, date, shape, ns, speedup, **meta):
        rows = [{"m": shape[0], "k": shape[1], "n": n, "speedup": speedup, "eager_speedup": speedup} for n in ns]
        doc = {"device": "G", "dtype": "bf16", "l2": "cold", "date": date, "commit": name[:3], "batch_sizes": ns,
               "rows": rows, **meta}
        (tmp_path / f"sparse24-sweep-{name}.json").write_text(json.dumps(doc))

    sweep("base", "2026-01-02", (64, 128), [1, 8], 1.5)
    # More batch sizes and newer than the base, and of other shapes: it adds them, and leaves the base the base.
    sweep("lm-heads", "2026-01-05", (50000, 128), [1, 8, 16, 32], 1.8, shape_set="lm heads")
    sweep("heads-warm", "2026-01-06", (70000, 128), [1], 1.9, shape_set="lm heads", l2="warm")  # not taken
    table, = expected_table.tables(tmp_path)["tables"]
    assert table["sources"][0]["file"] == "sparse24-sweep-base.json"
    assert table["shapes"]["64x128"] == [[1, 1.5, 1.5], [8, 1.5, 1.5]]
    assert table["shapes"]["50000x128"] == [[n, 1.8, 1.8] for n in (1, 8, 16, 32)]
    assert "70000x128" not in table["shapes"]
    (tmp_path / "sparse24-sweep-base.json").unlink()  # heads alone make no table: the sweep set is its base
    assert expected_table.tables(tmp_path)["tables"] == []


def test_the_newest_rows_take_each_cell_at_its_newest_reading_and_leave_the_heads_out(tmp_path, monkeypatch):
    """tools/readme_table.py's first rows: per GPU and dtype, the sweep set's cells as expected.json merges them."""
    import json
    import sys

    sys.path.insert(0, str(README.parent / "tools"))
    import readme_table

    def sweep(name, date, shapes, ns, speedup, **meta):
        rows = [{"m": m, "k": k, "n": n, "speedup": speedup, "eager_speedup": speedup / 2} for m, k in shapes
                for n in ns] + [{"m": m, "k": k, "memory": {"ratio": 0.5625}} for m, k in shapes]
        doc = {"device": "G", "dtype": "bf16", "l2": "cold", "date": date, "commit": name[:3], "batch_sizes": ns,
               "rows": rows, **meta}
        (tmp_path / f"sparse24-sweep-{name}.json").write_text(json.dumps(doc))

    shapes = [(4096, 4096), (6144, 4096)]  # of the sweep set
    sweep("base", "2026-01-02", shapes, [1, 64, 256, 1024], 1.5)
    sweep("new", "2026-01-03", shapes[:1], [256], 1.9)  # one cell run again after a rule changed
    sweep("lm-heads", "2026-01-04", [(128256, 4096)], [256], 0.5, shape_set="lm heads")
    monkeypatch.setattr(readme_table, "RESULTS", tmp_path)
    graph, eager = readme_table.newest_rows()
    cells = graph.split(" | ")[1:5]
    assert cells == ["1.50x (1.50-1.50x)", "1.50x (1.50-1.50x)", "1.70x (1.50-1.90x)", "1.50x (1.50-1.50x)"]
    assert eager.split(" | ")[3] == "0.85x (0.75-0.95x)"
    assert "(0.5625x bytes), bf16, 2 sweep shapes x 4 n" in graph  # the shapes the sweeps read
    assert graph.endswith("| G, 2 sweep files at bas, new (`sparse24/expected.json`'s sources) |")

    # The held-out models' projections get their own pair of rows, merged alike, where sweeps read them.
    held = [(2048, 2048), (1536, 8960)]  # Qwen2.5-3B's o, Qwen2.5-1.5B's down: outside the sweep set
    sweep("held-small", "2026-01-05", held, [1, 8], 1.2, shape_set="held-out models")
    sweep("held-mid", "2026-01-06", held[:1], [8, 256], 0.9, shape_set="held-out models")
    rows = readme_table.newest_rows()
    assert rows[:2] == [graph, eager]
    held_graph, held_eager = rows[2:]
    # n = 8 of 2048x2048 at its newest reading (0.9x, eager 0.45x) beside the three cells of 1.2x
    assert held_graph.split(" | ")[1:4] == ["1.20x (0.90-1.20x)", "-", "0.90x (0.90-0.90x)"]
    assert held_eager.split(" | ")[1] == "0.60x (0.45-0.60x)"
    assert "bf16, 2 projections of other public models (0.5-12B), outside the sweep set the rule was fitted on x 3 n" \
        in held_graph
    assert held_graph.endswith("| G, 2 sweep files at hel (`sparse24/expected.json`'s sources) |")

    # A sweep of given layers (--shapes FILE) is among the sources of each set whose layers it read (0073).
    sweep("given", "2026-01-07", shapes[1:], [1024], 1.3, shape_set="given")
    sweep("mixed", "2026-01-08", [shapes[0], held[0]], [64], 1.1, shape_set="given")
    graph, _, held_graph, _ = readme_table.newest_rows()
    assert graph.split(" | ")[2:5] == ["1.30x (1.10-1.50x)", "1.70x (1.50-1.90x)", "1.40x (1.30-1.50x)"]
    assert graph.endswith("| G, 4 sweep files at bas, new, giv, mix (`sparse24/expected.json`'s sources) |")
    assert held_graph.endswith("| G, 3 sweep files at hel, mix (`sparse24/expected.json`'s sources) |")
