"""How many clusters of each K-split tile the GPU runs at once: ``cuOccupancyMaxActiveClusters`` on the compiled
``cuda_ws`` kernel, for the small-n splits over 2, 3 and 4 CTAs and the 64-row block forms.

Why: the tile rule counts a grid's waves over the SMs its clusters can be placed on (``sparse24_ws_rule._cluster_sms``).
Clusters are placed inside a GPC, and a GPC's SMs are not a multiple of every cluster size, so clusters of 3 and 4
fill fewer than all 132 SMs of an H100 or H200.  A grid of one more cluster than fit runs a second wave: 40 clusters
of 3 (5120 rows of two 64-row blocks) ran 1.5x slower than 36 (docs/design/0063).  Beside each, the count the rule
uses on a device (``gpu_facts.device_facts``: an empty kernel of the same CTAs an SM, docs/design/0065), and the
picks of the sweep set and the held-out models that the device's slots move from the model's.  Writes
``bench/results/sparse24-cluster-slots-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_cluster_slots.py
"""

from __future__ import annotations

import argparse
import sys

from kernelplan.bench import results
from kernelplan.bench.shapes import BATCH_SIZES, held_out_shapes, sweep_shapes
from kernelplan.kernels.gpu_facts import device_facts, max_active_clusters
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import _deepest, resident, with_push, ws_config


def max_clusters(cfg, n: int, m: int) -> int:
    """The driver's count of ``cfg``'s clusters resident at once, for its launch at n x m on device 0."""
    launch, grid = WsKernel().launch_config(cfg, n, m, "bf16", False, None, 0)
    return max_active_clusters(launch.function, grid, cfg.threads, launch.shared)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms, rows = sm_count(0), []
    for bn, kc in ((16, 2), (24, 3), (32, 4), (64, 8)):
        for wm in (1, 2):
            cfg = _deepest(bn, wm, 1, kc)
            if cfg is None:
                continue
            cfg = with_push(cfg, 8, 4096, sms)
            clusters, probe = max_clusters(cfg, 8, 4096), device_facts(0).at(kc, resident(cfg))
            rows.append({"tile": str(cfg), "cluster": kc, "threads": cfg.threads, "shared": cfg.shared,
                         "clusters": clusters, "ctas": clusters * kc, "sms": sms, "resident": resident(cfg),
                         "probe_ctas": probe})
            print(f"{cfg}: {clusters} clusters of {kc} at once ({clusters * kc} CTAs on {sms} SMs; the probe's "
                  f"slots at {resident(cfg)} an SM: {probe})", flush=True)
    moved = picks_the_facts_move(device_facts(0))
    print(f"the rule's picks the driver's slots move from the model's ({len(moved)}):")
    for row in moved:
        print(f"  {row['m']}x{row['k']} n={row['n']} gated={row['gated']}: {row['model']} -> {row['driver']}")
    results.write("sparse24-cluster-slots", {"rows": rows, "moved": moved}, a.out, sms=sms)
    return 0


def picks_the_facts_move(slots) -> list[dict]:
    """The picks of ``ws_config`` over the sweep set and the held-out models, at every n of the sweep and gated or
    not, that ``slots`` moves from ``GpuFacts.model``'s for the same SMs."""
    out = []
    for m, k in [*sweep_shapes(), *held_out_shapes()]:
        for n in BATCH_SIZES:
            for gated in (False, True):
                model, driver = ws_config(n, m, k, slots.sms, gated), ws_config(n, m, k, slots.sms, gated, gpu=slots)
                if model != driver:
                    out.append({"m": m, "k": k, "n": n, "gated": gated, "model": str(model), "driver": str(driver)})
    return out


if __name__ == "__main__":
    sys.exit(main())
