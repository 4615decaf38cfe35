"""The compiled-kernel cache on disk (kernels/kernel_cache.py): keys, atomic writes, checksums, the LRU bound."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kernelplan.cache import PlanCacheWarning
from kernelplan.kernels.kernel_cache import KernelCache, cache_key


def test_the_key_changes_with_everything_the_bytes_depend_on():
    base = ("__global__ void k() {}", ("-std=c++17", "-lineinfo"), "sm_90a", "nvrtc 13.0")
    key = cache_key(*base)
    assert key == cache_key(*base) and len(key) == 64
    changed = [("__global__ void k() { }", *base[1:]), (base[0], ("-std=c++17",), *base[2:]),
               (*base[:2], "sm_90", base[3]), (*base[:3], "nvrtc 13.1")]
    assert len({cache_key(*c) for c in changed} | {key}) == 5


def test_a_second_cache_on_the_folder_reads_what_the_first_wrote(tmp_path):
    first = KernelCache(tmp_path)
    assert first.get("a" * 64) is None and first.misses == 1
    first.put("a" * 64, b"\x7fELF cubin bytes")
    second = KernelCache(tmp_path)  # as a new process would
    assert second.get("a" * 64) == b"\x7fELF cubin bytes" and second.hits == 1
    assert second.info()["entries"] == 1 and not list(tmp_path.glob(".*.tmp"))


def test_eight_processes_writing_one_kernel_at_once_leave_one_valid_file(tmp_path):
    script = textwrap.dedent(f"""
        from kernelplan.kernels.kernel_cache import KernelCache
        cache = KernelCache({str(tmp_path)!r})
        for _ in range(50):
            cache.put("k" * 64, bytes(range(256)) * 400)
        print("ok")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    assert all(p.communicate(timeout=300)[0].strip() == "ok" for p in procs)
    assert KernelCache(tmp_path).get("k" * 64) == bytes(range(256)) * 400
    assert [p.name for p in tmp_path.iterdir()] == ["k" * 64 + ".cubin"]  # no temporaries left


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "not ours"])
def test_a_damaged_file_is_dropped_with_a_warning_and_compiled_again(tmp_path, damage):
    cache = KernelCache(tmp_path)
    cache.put("d" * 64, b"payload" * 100)
    path = tmp_path / ("d" * 64 + ".cubin")
    blob = path.read_bytes()
    path.write_bytes({"truncated": blob[:-10], "flipped byte": blob[:-1] + bytes([blob[-1] ^ 1]),
                      "not ours": b"garbage"}[damage])
    with pytest.warns(PlanCacheWarning, match="fails its checksum"):
        assert cache.get("d" * 64) is None
    assert not path.exists() and cache.dropped == 1


def test_the_folder_is_bounded_least_recently_used_first(tmp_path):
    cache = KernelCache(tmp_path, max_bytes=4 * (1000 + 40))  # four files of 1000 bytes, 40 of header each
    for i, key in enumerate("abcd"):
        cache.put(key * 64, bytes(1000))
        os.utime(tmp_path / f"{key * 64}.cubin", (time.time() - 100 + i, time.time() - 100 + i))
    assert cache.get("a" * 64) is not None  # a read makes it the most recent
    cache.put("e" * 64, bytes(1000))
    left = sorted(p.name[0] for p in tmp_path.iterdir())
    assert left == ["a", "c", "d", "e"] and cache.info()["size_bytes"] <= cache.max_bytes


def test_a_folder_that_cannot_be_written_keeps_kernels_in_memory_with_one_warning(tmp_path):
    (tmp_path / "file").write_text("x")
    cache = KernelCache(tmp_path / "file")
    with pytest.warns(PlanCacheWarning, match="cannot be written .* memory only") as said:
        cache.put("a" * 64, b"x")
        cache.put("b" * 64, b"y")
    assert len(said) == 1 and cache.unusable and cache.get("a" * 64) is None


@pytest.mark.skipif(importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None,
                    reason="NVRTC needs cuda-bindings (pip install cuda-bindings nvidia-cuda-nvrtc)")
def test_a_second_process_loads_the_cubin_without_calling_nvrtc(tmp_path):
    """NVRTC compiles for sm_90 on a machine without a GPU; the second process finds the first one's cubin."""
    script = textwrap.dedent("""
        import hashlib
        from kernelplan.kernels import nvrtc
        binary = nvrtc.cubin('extern "C" __global__ void k(int *p) { p[threadIdx.x] = 1; }', "sm_90")
        print(nvrtc.COMPILES[0], hashlib.sha256(binary).hexdigest())
    """)
    env = {**os.environ, "KERNELPLAN_CACHE_DIR": str(tmp_path)}
    try:
        first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("NVRTC did not answer")
    if first.returncode != 0 and "nvrtc" in first.stderr.lower() and "not found" in first.stderr.lower():
        pytest.skip("the NVRTC library is not installed (pip install nvidia-cuda-nvrtc)")
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    compiles, digest = first.stdout.split()
    assert compiles == "1" and second.stdout.split() == ["0", digest]
