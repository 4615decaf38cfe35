"""Shared test set-up.  Nothing here queries CUDA at import time."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Asked once, after collection, never at import: the suite collects on any machine.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_plan_cache(tmp_path, monkeypatch):
    """Every test gets its own plan cache directory, so tests never share measurements."""
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path / "kp-cache"))
    yield


@pytest.fixture
def seed():
    """Fresh random inputs per run; the seed is printed on failure to reproduce it."""
    s = torch.seed() % (2**31)
    torch.manual_seed(s)
    print(f"torch seed {s}")
    return s


@pytest.fixture
def compile_for():
    """``compile_for(source, arch)``: the cubin NVRTC builds on this machine (no GPU needed); skips where
    cuda-bindings or the NVRTC library is missing."""
    nvrtc_bindings = pytest.importorskip("cuda.bindings.nvrtc")
    from kernelplan.kernels import nvrtc

    try:
        nvrtc._nvrtc_version(nvrtc_bindings)
    except Exception as e:  # no NVRTC library next to the bindings
        pytest.skip(f"NVRTC is not loadable here: {e}")
    return lambda source, arch: nvrtc._compile(nvrtc_bindings, source, arch)
