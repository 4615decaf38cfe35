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
from helpers import in_processes


def test_the_key_changes_with_everything_the_bytes_depend_on():
    base = ("__global__ void k() {}", ("-std=c++17", "-lineinfo"), "sm_90a", "nvrtc 13.0")
    key = cache_key(*base)
    assert key == cache_key(*base) and len(key) == 64
    changed = [("__global__ void k() { }", *base[1:]), (base[0], ("-std=c++17",), *base[2:]),
               (*base[:2], "sm_90", base[3]), (*base[:3], "nvrtc 13.1")]
    assert len({cache_key(*c) for c in changed} | {key}) == 5


@pytest.mark.skipif(importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None,
                    reason="nvrtc.cubin imports cuda-bindings")
def test_a_cubins_key_holds_the_driver_version(monkeypatch):
    from kernelplan import cache as cache_module
    from kernelplan.kernels import kernel_cache as kc
    from kernelplan.kernels import nvrtc

    keys = []
    monkeypatch.setattr(nvrtc, "_nvrtc_version", lambda _: "nvrtc 13.0")
    monkeypatch.setattr(nvrtc, "_compile", lambda *a: b"cubin")
    monkeypatch.setattr(kc.KernelCache, "get", lambda self, key: keys.append(key))
    monkeypatch.setattr(kc.KernelCache, "put", lambda self, key, payload: None)
    for driver in ("12080", "13000"):
        monkeypatch.setattr(cache_module, "driver_version", lambda d=driver: d)
        nvrtc.cubin.cache_clear()  # (also kept per process)
        nvrtc.cubin("__global__ void k() {}", "sm_90a")
    nvrtc.cubin.cache_clear()
    assert len(set(keys)) == 2


def test_a_second_cache_on_the_folder_reads_what_the_first_wrote(tmp_path):
    first = KernelCache(tmp_path)
    assert first.get("a" * 64) is None and first.misses == 1
    first.put("a" * 64, b"\x7fELF cubin bytes")
    second = KernelCache(tmp_path)  # as a new process would
    assert second.get("a" * 64) == b"\x7fELF cubin bytes" and second.hits == 1
    assert second.info()["entries"] == 1 and not list(tmp_path.glob(".*.tmp"))


def _kernel_writer(folder) -> None:
    cache = KernelCache(folder)
    for _ in range(50):
        cache.put("k" * 64, bytes(range(256)) * 400)


def test_eight_processes_writing_one_kernel_at_once_leave_one_valid_file(tmp_path):
    assert in_processes(_kernel_writer, [(tmp_path,)] * 8) == [0] * 8
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


# Triton compiles for sm_90 without a GPU (it ships ptxas): kernelplan's scope decides where the result goes.
_TRITON_SCRIPT = textwrap.dedent("""
    import os, sys, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernelplan.kernels.triton_cache import compiling

    @triton.jit
    def add_one(x, n, B: tl.constexpr):
        o = tl.arange(0, B)
        tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)

    before = triton.knobs.cache.dir
    for block in map(int, sys.argv[1:]):
        with compiling():
            inside = triton.knobs.cache.dir
            triton.compile(ASTSource(add_one, signature={"x": "*fp32", "n": "i32", "B": "constexpr"},
                                     constexprs={"B": block}), target=GPUTarget("cuda", 90, 32))
    print(before == triton.knobs.cache.dir, inside)
""")


def _triton_compile(tmp_path, blocks=(128,), **env):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")} | {
        "KERNELPLAN_CACHE_DIR": str(tmp_path / "kp"), "TRITON_HOME": str(tmp_path / "home"), **env}
    script = tmp_path / "compile_one.py"  # Triton reads a kernel's source from its file
    script.write_text(_TRITON_SCRIPT)
    out = subprocess.run([sys.executable, str(script), *map(str, blocks)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def _entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_kernelplans_triton_compiles_land_in_its_folder_and_triton_keeps_its_own(tmp_path):
    out = _triton_compile(tmp_path)
    restored, inside = out.stdout.split()
    assert restored == "True" and inside == str(tmp_path / "kp" / "triton")
    assert len(_entries(tmp_path / "kp" / "triton")) == 1
    assert _entries(tmp_path / "home" / ".triton" / "cache") == []  # Triton's default folder got nothing
    from kernelplan.kernels.triton_cache import TritonCache

    cache = TritonCache(tmp_path / "kp" / "triton")
    assert cache.info()["entries"] == 1 and cache.info()["size_bytes"] > 0
    assert cache.clear() == 1 and cache.info()["entries"] == 0


def test_a_users_triton_cache_dir_wins(tmp_path):
    mine = tmp_path / "mine"
    out = _triton_compile(tmp_path, TRITON_CACHE_DIR=str(mine))
    assert out.stdout.split() == ["True", str(mine)]
    assert len(_entries(mine)) == 1 and _entries(tmp_path / "kp" / "triton") == []


def test_an_unwritable_triton_folder_warns_once_and_triton_caches_in_its_own(tmp_path):
    (tmp_path / "kp").mkdir()
    (tmp_path / "kp" / "triton").write_text("a file where the folder should be")
    out = _triton_compile(tmp_path, blocks=(128, 256))
    assert out.stdout.split()[1] == str(tmp_path / "home" / ".triton" / "cache")
    said = [line for line in out.stderr.splitlines() if "PlanCacheWarning: kernelplan's Triton cache" in line]
    assert len(said) == 1 and "cannot be written" in said[0], out.stderr  # (and one log line)
    assert len(_entries(tmp_path / "home" / ".triton" / "cache")) == 2


def test_the_triton_folder_is_bounded_oldest_first(tmp_path):
    from kernelplan.kernels.triton_cache import TritonCache

    cache = TritonCache(tmp_path, max_bytes=3000)
    for i, name in enumerate("abcd"):
        (tmp_path / name).mkdir()
        f = tmp_path / name / "kernel.cubin"
        f.write_bytes(bytes(1000))
        os.utime(f, (time.time() - 100 + i, time.time() - 100 + i))
    cache.evict()
    assert _entries(tmp_path) == ["b", "c", "d"] and cache.info()["size_bytes"] == 3000


@pytest.mark.gpu
def test_on_the_gpu_kernelplans_triton_kernels_compile_into_its_folder_and_a_second_process_reuses_them(tmp_path):
    script = textwrap.dedent("""
        import torch, kernelplan as kp
        w = kp.sparse24.prune(torch.randn(256, 512, device="cuda")).to(torch.bfloat16)
        kp.sparse24.compress(w)  # the Triton compressor
        torch.cuda.synchronize()
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")} | {
        "KERNELPLAN_CACHE_DIR": str(tmp_path / "kp"), "TRITON_HOME": str(tmp_path / "home")}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        if _ == 0:
            first = {p.name: p.stat().st_mtime for p in (tmp_path / "kp" / "triton").iterdir()}
    assert first and {p.name: p.stat().st_mtime for p in (tmp_path / "kp" / "triton").iterdir()} == first
    default = tmp_path / "home" / ".triton" / "cache"
    names = {p.name for p in default.iterdir()} if default.is_dir() else set()
    assert not names & set(first)  # none of kernelplan's kernels went to Triton's own folder
