"""tools/model_bound.py: Amdahl's bound of a model step from a profile, on hand-made numbers."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))

import model_bound  # noqa: E402


def _row(dense_ms, sparse_ms, gemm_dense, sparse_kernels, sparse_gemm=0.0):
    split = {"dense": {"gemm": gemm_dense, "2:4": 0.0}, "sparse": {"gemm": sparse_gemm, "2:4": sparse_kernels}}
    return {"case": "c", "graph_dense_ms": dense_ms, "graph_sparse_ms": sparse_ms, "device_ms_by_kernel": split}


def test_bound_splits_a_step_into_its_linear_layers_and_the_rest():
    # dense: 3.0 ms, 2.0 of them linear; sparse: 1.9 ms, 0.9 in 2:4 kernels and 0.1 in a GEMM left dense.
    b = model_bound.bound(_row(3.0, 1.9, 2.0, 0.9, 0.1), target=1.25, limit=2.0)
    assert b["rest_dense_ms"] == pytest.approx(1.0)
    assert b["rest_sparse_ms"] == pytest.approx(0.9)
    assert b["linear_speedup"] == pytest.approx(2.0)
    assert b["model_speedup"] == pytest.approx(3.0 / 1.9)
    # The GEMM left dense costs 0.1 ms in both models: the 2:4 layers did 1.9 ms of dense work in 0.9.
    assert b["left_ms"] == pytest.approx(0.1)
    assert b["sparse_layers_speedup"] == pytest.approx(1.9 / 0.9)
    # 1.25x is a 2.4 ms step: 1.4 ms left, past the sparse model's rest and the dense GEMM, for 1.9 ms of dense work.
    assert b["needed"] == pytest.approx(1.9 / 1.4)
    assert b["at_limit"] == pytest.approx(3.0 / (0.9 + 0.1 + 1.9 / 2.0))


def test_a_target_the_rest_alone_exceeds_needs_an_infinite_speedup():
    b = model_bound.bound(_row(3.0, 2.9, 1.0, 0.5), target=1.5, limit=2.0)  # rest 2.4 ms > 3.0 / 1.5
    assert math.isinf(b["needed"])
    assert b["at_limit"] < 1.5


def test_the_committed_profile_reads(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["model_bound.py"])
    model_bound.main()
    out = capsys.readouterr().out
    assert "decode batch 128" in out and "prefill 512" in out
