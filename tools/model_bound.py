"""How far the 2:4 linear layers can move a model's step: Amdahl's bound from ``sparse24_model.py --profile``.

Reads a committed profile (no GPU).  Per case, the step's graph time is split into its linear layers (the device
time CUPTI gave their kernels in the eager step: cuBLAS's GEMMs for dense, the 2:4 kernels and any GEMM left for the
sparse model) and the rest (attention, norms, rotary, the KV cache, launch gaps: the graph's time less the linear
layers').  It prints the linear layers' speedup as measured, the model's, the linear speedup a target needs with the
sparse model's rest as it is, and the model's speedup if the linear layers ran at ``--limit`` (2.0: the `mma.sp` /
`wgmma.sp` rate over dense, which a kernel cannot beat).

    python tools/model_bound.py [bench/results/sparse24-model-profile-h100.json] [--target 1.3]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def bound(row: dict, target: float, limit: float) -> dict:
    """One case's split (ms) and speedups.  The GEMMs the sparse model still runs (``left``: a layer left dense,
    such as a head tied to the embeddings, Gemma-2's) are taken to cost what they cost in the dense model: the 2:4
    layers' own speedup is the rest of the dense model's linear time over the 2:4 kernels', and ``needed`` and
    ``at_limit`` move only that part.  ``needed`` is inf where the sparse model's rest and ``left`` alone exceed the
    target's step time."""
    split = row["device_ms_by_kernel"]
    lin_dense = split["dense"]["gemm"] + split["dense"]["2:4"]
    left = split["sparse"]["gemm"]
    lin_sparse = left + split["sparse"]["2:4"]
    dense, sparse = row["graph_dense_ms"], row["graph_sparse_ms"]
    rest = sparse - lin_sparse
    room = dense / target - rest - left
    pruned = lin_dense - left  # the dense model's time in the layers the sparse one runs 2:4
    return {"case": row["case"], "dense_ms": dense, "linear_dense_ms": lin_dense, "rest_dense_ms": dense - lin_dense,
            "rest_sparse_ms": rest, "left_ms": left, "linear_speedup": lin_dense / lin_sparse,
            "sparse_layers_speedup": pruned / split["sparse"]["2:4"], "model_speedup": dense / sparse,
            "needed": pruned / room if room > 0 else math.inf, "at_limit": dense / (rest + left + pruned / limit)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="?", default=str(RESULTS / "sparse24-model-profile-h100.json"))
    ap.add_argument("--target", type=float, default=1.3, help="the model speedup asked for (issue 26: 1.3)")
    ap.add_argument("--limit", type=float, default=2.0, help="the linear layers' largest possible speedup")
    a = ap.parse_args()
    with open(a.profile) as f:
        doc = json.load(f)
    meta = doc["meta"]
    print(f"{meta['model']}, {meta['layers']} layers, {meta['device']} at {meta['commit']}: graph step, ms")
    print(f"{'case':<18}{'dense':>7}{'linear':>8}{'rest':>7}{'rest 2:4':>9}{'left':>7}{'linear x':>10}{'2:4 x':>7}"
          f"{'model x':>9}{'needs x':>9}{'at ' + str(a.limit) + 'x':>9}")
    for row in doc["rows"]:
        b = bound(row, a.target, a.limit)
        print(f"{b['case']:<18}{b['dense_ms']:7.3f}{b['linear_dense_ms']:8.3f}{b['rest_dense_ms']:7.3f}"
              f"{b['rest_sparse_ms']:9.3f}{b['left_ms']:7.3f}{b['linear_speedup']:10.2f}"
              f"{b['sparse_layers_speedup']:7.2f}{b['model_speedup']:9.2f}{b['needed']:9.2f}{b['at_limit']:9.2f}")
    print(f"left: GEMMs the sparse model still runs (a layer left dense); 2:4 x: the 2:4 layers' own speedup, those "
          f"GEMMs taken out; needs x: the 2:4 layers' speedup for a {a.target}x step, the sparse model's rest as "
          f"measured")


if __name__ == "__main__":
    main()
