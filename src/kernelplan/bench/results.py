"""Where a bench script's results go, and the metadata every results file carries."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def gpu_tag(name: str) -> str:
    """``h200``, ``h100``, else the device name as a file-name part."""
    return "h200" if "H200" in name else "h100" if "H100" in name else name.replace(" ", "_").lower()


def write(kind: str, payload: dict, out: str | None = None, **meta) -> str:
    """Write ``{"meta": ..., **payload}`` to ``out`` or ``bench/results/<kind>-<gpu>.json``; return the path.

    The metadata is the device, torch, triton, commit (``KERNELPLAN_COMMIT``:
    the device copy's ``.git`` can be stale) and date, then ``meta``.
    """
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0)
    path = out or str(RESULTS / f"{kind}-{gpu_tag(gpu)}.json")
    head = {"device": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("KERNELPLAN_COMMIT", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta}
    with open(path, "w") as f:
        json.dump({"meta": head, **payload}, f, indent=1)
    print("wrote", path)
    return path
