"""The plan cache's fault matrix: no fault of the cache fails a computation, and no committed entry is lost."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import kernelplan as kp
from kernelplan.cache import PlanCache, PlanCacheWarning, SCHEMA_VERSION, plan_cache
from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan

PROBLEM = {"m": 64, "k": 128, "n": 4}


def _filled(path, n=3) -> PlanCache:
    cache = PlanCache(path)
    for i in range(n):
        cache.put("op", {**PROBLEM, "i": i}, {"v": i})
    cache.close()
    return cache


def _compute_through_the_default_cache():
    """Ops that read and write the process's default plan cache: a dispatch lookup, a store, an fp8 linear."""
    desc = GemmSparse24Descriptor(4, 64, 128, "f32", memory="fast")
    GemmSparse24Plan.measured(desc)
    GemmSparse24Plan.remember_fastest(desc, {"reference": 1e-3})
    x, w = torch.randn(3, 32), torch.randn(16, 32)
    return kp.fp8.linear(kp.fp8.quantize(x), kp.fp8.quantize(w), out_dtype=torch.float32)


@pytest.mark.parametrize("fault", ["dir is a file", "file is a dir", "parent is a file", "future schema"])
def test_an_unusable_cache_warns_once_and_computations_go_on_in_memory(tmp_path, monkeypatch, fault):
    if fault == "dir is a file":
        (tmp_path / "c").write_text("x")
        where = tmp_path / "c"
    elif fault == "file is a dir":
        (tmp_path / "c" / "plans.sqlite").mkdir(parents=True)
        where = tmp_path / "c"
    elif fault == "parent is a file":
        (tmp_path / "f").write_text("x")
        where = tmp_path / "f" / "c"
    else:
        where = tmp_path / "c"
        _filled(where / "plans.sqlite")
        with sqlite3.connect(where / "plans.sqlite") as conn:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(where))
    with pytest.warns(PlanCacheWarning, match=r"cannot be used .* memory only: (point|it was written)") as said:
        y = _compute_through_the_default_cache()
        _compute_through_the_default_cache()
    assert torch.isfinite(y).all() and len([w for w in said if "cannot be used" in str(w.message)]) == 1
    cache = plan_cache()
    desc = GemmSparse24Descriptor(4, 64, 128, "f32", memory="fast")
    assert cache.unusable and GemmSparse24Plan.measured(desc)["backend"] == "reference"  # kept in memory
    assert sorted(os.listdir(tmp_path)) == before  # nothing created, moved or set aside
    assert not list(tmp_path.rglob("*.corrupt"))
    info = cache.info()
    assert info["unusable"] and info["entries"] == 0


def test_the_cli_reports_an_unusable_cache_in_lines_not_a_traceback(tmp_path):
    (tmp_path / "c").write_text("x")
    env = {**os.environ, "KERNELPLAN_CACHE_DIR": str(tmp_path / "c")}
    out = subprocess.run([sys.executable, "-m", "kernelplan", "cache", "info"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "unusable:" in out.stdout


def test_a_read_only_valid_cache_is_read_and_new_results_stay_in_memory(tmp_path, monkeypatch):
    path = tmp_path / "plans.sqlite"
    _filled(path)
    before = path.read_bytes()
    real = os.access
    # A read-only directory; as root the kernel ignores mode bits, so the check is what is made to say so.
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if mode == os.W_OK else real(p, mode, **k))
    cache = PlanCache(path)
    assert cache.get("op", {**PROBLEM, "i": 1}) == {"v": 1}
    with pytest.warns(PlanCacheWarning, match="is read-only"):
        cache.put("op", {**PROBLEM, "i": 9}, {"v": 9})
    assert cache.get("op", {**PROBLEM, "i": 9}) == {"v": 9} and cache.read_only
    cache.close()
    assert path.read_bytes() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only mode bits")
def test_a_read_only_directory_for_real(tmp_path):
    path = tmp_path / "plans.sqlite"
    _filled(path)
    os.chmod(tmp_path, 0o555)
    try:
        cache = PlanCache(path)
        assert cache.get("op", {**PROBLEM, "i": 2}) == {"v": 2}
        with pytest.warns(PlanCacheWarning):
            cache.put("op", {**PROBLEM, "i": 9}, {"v": 9})
    finally:
        os.chmod(tmp_path, 0o755)


def test_bad_rows_count_as_missing_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))
    desc = GemmSparse24Descriptor(4, 64, 128, "f32", memory="fast")
    GemmSparse24Plan.remember_fastest(desc, {"reference": 1e-3})
    cache = plan_cache()
    cache.put("op", PROBLEM, {"v": 1})
    with sqlite3.connect(cache.path) as conn:
        conn.execute("UPDATE plans SET value = '{not json' WHERE op = 'op'")
        conn.execute("UPDATE plans SET value = '[\"cuda_sp\", 1]' WHERE op != 'op'")
    fresh = PlanCache(cache.path)
    monkeypatch.setitem(__import__("kernelplan.cache").cache._AT_DEFAULT, PlanCache, (cache.path, fresh))
    with pytest.warns(PlanCacheWarning, match="does not parse"):
        assert fresh.get("op", PROBLEM) is None
    with pytest.warns(PlanCacheWarning, match="not a {'backend': name} record"):
        assert GemmSparse24Plan.measured(desc) is None
        assert GemmSparse24Plan.select(desc).backend.name  # dispatch goes on by priority


def test_a_full_disk_is_not_damage_and_moves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "plans.sqlite"
    _filled(path)
    cache = PlanCache(path)
    assert cache.get("op", {**PROBLEM, "i": 0}) == {"v": 0}

    def full(*a, **k):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(PlanCache, "_write", full)
    with pytest.warns(PlanCacheWarning, match="disk is full"):
        cache.put("op", {**PROBLEM, "i": 7}, {"v": 7})
    assert cache.get("op", {**PROBLEM, "i": 7}) == {"v": 7}  # in memory
    monkeypatch.undo()
    assert not (tmp_path / "plans.sqlite.corrupt").exists()
    assert PlanCache(path).get("op", {**PROBLEM, "i": 2}) == {"v": 2}  # the file is where it was, whole


def test_warnings_as_errors_do_not_fail_a_computation(tmp_path, monkeypatch):
    (tmp_path / "c").write_text("x")
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path / "c"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(_compute_through_the_default_cache()).all()


def test_warnings_as_errors_do_not_fail_a_2_4_layers_computation_and_the_message_is_logged(monkeypatch, caplog):
    """kernelplan's own warnings (``_checks.warn``, ``warn_once``) under ``-W error``: an op that reads a 2:4 layer's
    weight (run on a dense copy, which warns) still computes, and the warning goes to the ``kernelplan`` logger.
    Before, the filter raised it out of the op."""
    from kernelplan import _checks

    monkeypatch.setattr(_checks, "_WARNED", set())  # warned before in this process or not, it warns here
    torch.manual_seed(0)
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(64, 32))
    x = torch.randn(3, 64)
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="kernelplan"):
        warnings.simplefilter("error")
        y = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(y, layer(x))
    assert "read a 2:4 layer's weight" in caplog.text
    with warnings.catch_warnings(record=True) as caught:  # without the filter, a warning as before
        warnings.simplefilter("always")
        _checks.warn("a message", UserWarning)
    assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, "a message")]


def test_a_fault_in_one_process_never_costs_another_process_its_entries(tmp_path):
    """v1 took any non-"locked" OperationalError for damage and moved the live file: 1,750 of 1,750 entries lost.

    A writer process commits entries while this process meets I/O errors on the same file.
    """
    path = tmp_path / "plans.sqlite"
    _filled(path, 1)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from kernelplan.cache import PlanCache
        cache = PlanCache({str(path)!r})
        for i in range(400):
            cache.put("w", {{"i": i}}, i)
        print("done")
    """)], stdout=subprocess.PIPE, text=True)
    ours = PlanCache(path)
    real = PlanCache._read

    def flaky(self, conn, key):
        raise sqlite3.OperationalError("disk I/O error")

    PlanCache._read = flaky
    try:
        with pytest.warns(PlanCacheWarning, match="disk I/O error"):
            for i in range(50):
                assert ours.get("op", {"probe": i}) is None
    finally:
        PlanCache._read = real
    out, _ = writer.communicate(timeout=300)
    assert writer.returncode == 0 and out.strip() == "done"
    check = PlanCache(path)
    assert all(check.get("w", {"i": i}) == i for i in range(400))
    assert not (tmp_path / "plans.sqlite.corrupt").exists()


def test_kill_9_in_the_middle_of_writes_loses_no_committed_entry(tmp_path):
    """A writer killed mid-run: every put it reported done is there, and the file opens without a warning."""
    path = tmp_path / "plans.sqlite"
    writer = subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(f"""
        from kernelplan.cache import PlanCache
        cache = PlanCache({str(path)!r})
        i = 0
        while True:
            cache.put("k", {{"i": i, "pad": "x" * 500}}, i)
            print(i, flush=True)
            i += 1
    """)], stdout=subprocess.PIPE, text=True)
    done = -1
    for line in writer.stdout:
        done = int(line)
        if done >= 300:
            break
    writer.kill()  # SIGKILL, between or inside a transaction
    writer.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged file would warn here
        cache = PlanCache(path)
        assert all(cache.get("k", {"i": i, "pad": "x" * 500}) == i for i in range(done + 1))
    assert cache.unusable is None and not (tmp_path / "plans.sqlite.corrupt").exists()
