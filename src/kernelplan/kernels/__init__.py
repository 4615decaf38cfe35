"""Bespoke Triton kernels.  Importing this package does not import Triton.

Each kernel module imports ``triton`` at its top and is itself imported
lazily, from a backend's ``run``; ``triton_reason`` answers a backend's
``supports`` without importing anything heavy.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_reason(device: str) -> str | None:
    """Why a Triton backend cannot run on ``device``, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed: pip install 'kernelplan[gpu]'"
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return None
    return f"device {device}: Triton kernels run on CUDA devices (and on CPU only under TRITON_INTERPRET=1)"
