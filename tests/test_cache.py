"""The persistent plan cache: memory layer, LRU bound, 8 writers at once, corruption, CLI."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kernelplan.cache import PlanCache, PlanCacheWarning, environment_fingerprint, plan_cache
from helpers import in_processes, kernelplan_cli

PROBLEM = {"m": 8192, "k": 8192, "n": 16, "dtype": "bf16", "layout": "tn", "epilogue": "bias"}


def test_round_trip_and_key_carries_the_environment(tmp_path):
    cache = PlanCache(tmp_path / "p.sqlite")
    assert cache.get("sparse24_gemm", PROBLEM) is None
    cache.put("sparse24_gemm", PROBLEM, {"alg": 3, "split_k": 2})
    assert cache.get("sparse24_gemm", PROBLEM) == {"alg": 3, "split_k": 2}
    assert PlanCache(tmp_path / "p.sqlite").get("sparse24_gemm", PROBLEM) == {"alg": 3, "split_k": 2}
    key = json.loads(PlanCache.make_key("sparse24_gemm", PROBLEM))
    assert key[0] == "sparse24_gemm" and key[1] == PROBLEM
    assert {"kernelplan", "torch", "triton", "device_type"} <= set(key[2])
    assert key[2] == environment_fingerprint("cpu")
    assert PlanCache(tmp_path / "p.sqlite").get("sparse24_gemm", {**PROBLEM, "n": 32}) is None


def test_a_hit_touches_no_disk_and_is_cheap(tmp_path):
    cache = PlanCache(tmp_path / "p.sqlite")
    cache.put("op", PROBLEM, {"alg": 1})
    fresh = PlanCache(tmp_path / "p.sqlite")
    fresh.get("op", PROBLEM)
    reads = fresh.disk_reads
    os.chmod(tmp_path, 0o500)  # even an unreadable directory cannot stop a memory hit
    try:
        t0 = time.perf_counter()
        for _ in range(2000):
            assert fresh.get("op", PROBLEM) == {"alg": 1}
        per_hit_us = (time.perf_counter() - t0) / 2000 * 1e6
    finally:
        os.chmod(tmp_path, 0o700)
    assert fresh.disk_reads == reads
    print(f"plan-cache memory hit: {per_hit_us:.2f} us")
    assert per_hit_us < 50, f"a memory hit cost {per_hit_us:.1f} us"


def test_bounded_with_lru_eviction(tmp_path):
    cache = PlanCache(tmp_path / "p.sqlite", max_entries=5)
    for i in range(5):
        cache.put("op", {"i": i}, i)
        time.sleep(0.002)
    PlanCache(tmp_path / "p.sqlite", max_entries=5).get("op", {"i": 0})  # 0 is now recently used
    for i in range(5, 8):
        time.sleep(0.002)
        cache.put("op", {"i": i}, i)
    reader = PlanCache(tmp_path / "p.sqlite", max_entries=5)
    assert reader.info()["entries"] == 5
    present = {i for i in range(8) if reader.get("op", {"i": i}) is not None}
    assert present == {0, 4, 5, 6, 7}


def _writer(path, worker: int) -> None:
    cache = PlanCache(path)
    for i in range(40):
        cache.put("op", {"worker": worker, "i": i}, {"v": worker * 1000 + i})
        cache.put("op", {"shared": i % 5}, {"by": worker})  # contended keys
        if cache.get("op", {"worker": worker, "i": i}) != {"v": worker * 1000 + i}:
            raise SystemExit(f"worker {worker} lost its entry {i}")


def test_eight_processes_writing_at_once(tmp_path):
    path = tmp_path / "p.sqlite"
    assert all(code == 0 for code in in_processes(_writer, [(path, w) for w in range(8)]))
    cache = PlanCache(path)
    assert cache.info()["entries"] == 8 * 40 + 5
    for w in range(8):
        for i in range(40):
            assert cache.get("op", {"worker": w, "i": i}) == {"v": w * 1000 + i}
    assert all(cache.get("op", {"shared": s})["by"] in range(8) for s in range(5))


def test_garbage_file_is_rebuilt_with_a_warning(tmp_path):
    path = tmp_path / "p.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    cache = PlanCache(path)
    with pytest.warns(PlanCacheWarning, match="was damaged"):
        assert cache.get("op", PROBLEM) is None
    cache.put("op", PROBLEM, 7)
    assert PlanCache(path).get("op", PROBLEM) == 7
    assert Path(f"{path}.corrupt").exists()


def test_truncated_file_is_rebuilt_with_a_warning(tmp_path):
    path = tmp_path / "p.sqlite"
    cache = PlanCache(path)
    for i in range(300):
        cache.put("op", {"i": i, "pad": "x" * 200}, i)
    cache.close()
    for extra in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        extra.unlink(missing_ok=True)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 3)
    fresh = PlanCache(path)
    with pytest.warns(PlanCacheWarning):
        fresh.get("op", {"i": 1, "pad": "x" * 200})
    fresh.put("op", PROBLEM, 1)
    assert PlanCache(path).get("op", PROBLEM) == 1


def test_default_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert plan_cache().path == tmp_path / "elsewhere" / "plans.sqlite"


def test_cli_info_and_clear(tmp_path):
    env = {**os.environ, "KERNELPLAN_CACHE_DIR": str(tmp_path)}
    from kernelplan.kernels.kernel_cache import KernelCache

    PlanCache(tmp_path / "plans.sqlite").put("op", PROBLEM, 1)
    KernelCache(tmp_path / "kernels").put("k" * 64, b"cubin")
    run = lambda *a: kernelplan_cli(*a, env=env)  # noqa: E731
    info = run("cache", "info", "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    plans, kernels = data["plans"], data["kernels"]
    assert plans["entries"] == 1 and plans["path"] == str(tmp_path / "plans.sqlite") and plans["size_bytes"] > 0
    assert kernels["entries"] == 1 and kernels["path"] == str(tmp_path / "kernels")
    only = json.loads(run("cache", "info", "--json", "--which", "kernels").stdout)
    assert only == kernels
    cleared = run("cache", "clear", "--which", "plans")
    assert cleared.returncode == 0 and "cleared 1 entries from the plans cache" in cleared.stdout
    assert json.loads(run("cache", "info", "--json").stdout)["kernels"]["entries"] == 1
    assert "cleared 1 entries from the kernels cache" in run("cache", "clear").stdout
    text = run("cache", "info")
    assert text.stdout.count("entries:   0") == 3  # plans, kernels and kernelplan's Triton folder
    assert data["triton"]["path"] == str(tmp_path / "triton") and data["triton"]["entries"] == 0
    bad = run("cache", "frobnicate")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
