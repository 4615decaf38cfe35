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


# The driver's attributes a results file records of its GPU: what tells two GPUs of one SM count apart (the H100 and
# the H200 differ in their DRAM, not their SMs; docs/design/0054).
GPU_ATTRIBUTES = {"sms": "MULTIPROCESSOR_COUNT", "l2_bytes": "L2_CACHE_SIZE", "memory_clock_khz": "MEMORY_CLOCK_RATE",
                  "memory_bus_bits": "GLOBAL_MEMORY_BUS_WIDTH", "clock_khz": "CLOCK_RATE"}


def gpu_attributes(device_index: int | None = 0) -> dict:
    """``GPU_ATTRIBUTES`` of CUDA device ``device_index`` (None: the current one), and on sm_90 and later what the
    tile rule reads of it (``kernels.gpu_facts``); where the driver cannot give them, why (a results file's metadata
    is never the reason a bench fails)."""
    import torch

    from ..kernels.nvrtc import device_attribute

    try:
        index = torch.cuda.current_device() if device_index is None else device_index
        out = {key: device_attribute(index, name) for key, name in GPU_ATTRIBUTES.items()}
    except Exception as e:  # noqa: BLE001 - the bench's results matter more than this record of its GPU
        return {"unreadable": f"{type(e).__name__}: {e}"}
    try:
        if device_attribute(index, "COMPUTE_CAPABILITY_MAJOR") >= 9:  # what cuda_ws's rule reads
            from ..kernels.gpu_facts import device_facts

            out["rule_facts"] = device_facts(index).to_json()
    except Exception as e:  # noqa: BLE001
        out["rule_facts"] = f"unreadable: {type(e).__name__}: {e}"
    return out


def write(kind: str, payload: dict, out: str | None = None, **meta) -> str:
    """Write ``{"meta": ..., **payload}`` to ``out`` or ``bench/results/<kind>-<gpu>.json``; return the path.

    The metadata is the device, its attributes (``gpu_attributes``), torch, triton, commit
    (``KERNELPLAN_COMMIT``: the device copy's ``.git`` can be stale) and date, then ``meta``.
    """
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0)
    path = out or str(RESULTS / f"{kind}-{gpu_tag(gpu)}.json")
    head = {"device": gpu, "gpu": gpu_attributes(0), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("KERNELPLAN_COMMIT", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta}
    with open(path, "w") as f:
        json.dump({"meta": head, **payload}, f, indent=1)
    print("wrote", path)
    return path
