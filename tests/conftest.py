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
