"""tools/fit_backend_rule.py: the Hopper boundary between cuda_sp and cuda_ws read from the sweeps."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))

import fit_backend_rule  # noqa: E402
from kernelplan.sparse24 import dispatch  # noqa: E402

RESULTS = pathlib.Path(__file__).parents[1] / "bench" / "results"


def _row(n, m, k, sp_ms, ws_ms):
    return {"n": n, "m": m, "k": k, "cuda_sp_ms": sp_ms, "cuda_ws_ms": ws_ms, "speedup": 1.0}


def test_kind_names_backend_fors_kinds_of_weight():
    assert fit_backend_rule.kind(9216, 896) == fit_backend_rule.kind(59136, 8192) == "tall"
    assert fit_backend_rule.kind(4096, 14336) == "wide, few rows"
    assert fit_backend_rule.kind(3584, 18944) == fit_backend_rule.kind(1024, 4096) == "wide, fewest rows"
    assert fit_backend_rule.kind(4096, 4096) == "other"


def test_moves_time_each_moved_row_under_the_bound_against_todays_pick():
    rows = [_row(1, 9216, 2048, 10.0, 8.0), _row(8, 9216, 8192, 9.0, 12.0), _row(16, 9216, 2048, 10.0, 8.0),
            _row(1, 4096, 4096, 5.0, 4.0)]
    bound = dispatch.SP_TALL_MIN_K
    # With no bound every tall weight takes cuda_sp at n <= 8: only the K = 2048 row at n = 1 moves, to 10 / 8.
    assert fit_backend_rule.moves(rows, 0) == [(1.25, 9216, 2048, 1)]
    # Past every K, the K = 8192 row moves to cuda_ws: 12 / 9.
    assert fit_backend_rule.moves(rows, 10**6) == [(12.0 / 9.0, 9216, 8192, 8)]
    assert fit_backend_rule.moves(rows, dispatch.SP_TALL_MIN_K) == []
    assert dispatch.SP_TALL_MIN_K == bound  # the bound is back after each call
    ratios = fit_backend_rule.by_kind(rows)
    assert ratios[("tall", 1)] == [0.8] and ratios[("other", 1)] == [0.8] and ratios[("tall", 8)] == [12.0 / 9.0]


def test_report_reads_a_sweep_and_says_where_no_row_moves(tmp_path):
    path = tmp_path / "sweep.json"
    rows = [_row(1, 9216, 8192, 9.0, 12.0), {"m": 9216, "k": 8192, "memory": {}}, _row(32, 9216, 8192, 1.0, 1.0)]
    path.write_text(json.dumps({"device": "GPU", "commit": "abc", "rows": rows}))
    lines = fit_backend_rule.report(str(path), 4160)
    assert "1 rows at n <= 16" in lines[0] and "cuda_sp faster on 1" in lines[1]
    assert lines[-1].endswith("no row moves")


@pytest.mark.parametrize("name", ["sparse24-sweep-uneven-k-small-n-h200", "sparse24-sweep-f16-uneven-k-small-n-h200",
                                  "sparse24-sweep-small-n-h100", "sparse24-sweep-small-n-f16-h100",
                                  "sparse24-sweep-held-out-models-h200"])
def test_todays_tall_bound_runs_faster_than_none_on_the_sweeps_it_was_read_from(name):
    rows = fit_backend_rule.timed_rows(json.loads((RESULTS / f"{name}.json").read_text()))
    times = [t for t, *_ in fit_backend_rule.moves(rows, 0)]
    assert len(times) >= 10 and fit_backend_rule.geomean(times) > 1.0  # no bound: the moved rows run slower
