"""What opt-in tile tuning (``kp.sparse24.tune_tiles``, ``sparse24/tiles.py``) gains over the rule, timed afresh.

Phase 1 tunes every (M, K) of the sweep set (or ``--shape``) at each n of ``--batch``, as a user would (nothing read
from or written to the plan cache), and reports how long that took.  Phase 2 times again, in new rounds and on new
weight copies, dense ``F.linear``, the rule's tile and the kept tile, for every problem where tuning kept another
tile, side by side in CUDA graphs with the weights read past the L2: the gain phase 1 reported is the best of
several noisy readings and reads high; phase 2's is the one to quote.  Writes
``bench/results/sparse24-tile-tuning-<gpu>.json``, whose rows' ``tiles_ms`` (every candidate's tuning time) make it a
tile table for ``tools/fit_ws_rule.py`` too.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_tile_tuning.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.bench.sweep import copies_past_l2
from kernelplan.sparse24 import tiles
from kernelplan.timing import graph_rounds


def dense_calls(n: int, m: int, k: int, dtype) -> list:
    copies = copies_past_l2(torch.cuda.get_device_properties(0).L2_cache_size, 2 * m * k, "cold")
    ws = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(copies)]
    x = torch.randn(n, k, device="cuda").to(dtype)
    return [lambda w=w: F.linear(x, w) for w in ws]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[128, 256, 512])
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--top", type=int, default=tiles.DEFAULT_TOP)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.bfloat16
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else list(sweep_shapes())
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.sparse24.dispatch import backend_for

    t0 = time.perf_counter()  # every variant first, in threads: per shape, the tuning then only times
    sms, cap = sm_count(0), torch.cuda.get_device_capability(0)
    tiles.compile_all([(c, "bf16", None) for m, k in shapes for n in a.batch
                       for backend in [backend_for(cap, n, m, k, "bf16")] if backend in tiles.OPS
                       for c in tiles.candidates(n, m, k, sms, False, a.top, backend)], 0)
    compile_s = time.perf_counter() - t0
    rows, tune_s = [], 0.0
    for shape in shapes:
        t0 = time.perf_counter()
        choices = tiles.tune_tiles([shape], a.batch, dtype=dtype, top=a.top, rounds=a.rounds, store=False)
        tune_s += time.perf_counter() - t0
        for c in choices:
            row = {"m": c.m, "k": c.k, "n": c.n, "backend": tiles.backend_of(c.tile) if c.tile else None,
                   "rule": str(c.rule), "tile": str(c.tile), "tune_gain": c.gain,
                   "tiles_ms": c.times_ms}  # every candidate's tuning time, in the rule's order
            if c.tile is not None and c.tile != c.rule:
                fns = tiles.tile_calls([c.rule, c.tile], c.n, c.m, c.k, dtype, None, 0)
                fns = {"rule": fns[c.rule], "tuned": fns[c.tile], "dense": dense_calls(c.n, c.m, c.k, dtype)}
                ms = {name: statistics.median(t) for name, t in
                      graph_rounds(fns, tiles.calls_per_replay(c.n, c.m, c.k), a.rounds).items()}
                row |= {"dense_ms": ms["dense"], "rule_ms": ms["rule"], "tuned_ms": ms["tuned"],
                        "gain": ms["rule"] / ms["tuned"], "rule_speedup": ms["dense"] / ms["rule"],
                        "tuned_speedup": ms["dense"] / ms["tuned"]}
                print(f"{c.m:6d} x {c.k:<6d} n={c.n:5d}  vs dense: rule {row['rule_speedup']:.3f}x, tuned "
                      f"{row['tuned_speedup']:.3f}x; gain afresh {row['gain']:.3f} (tuning read {c.gain:.3f}) "
                      f"{c.tile} over {c.rule}", flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
        changed = [r for r in rows if "gain" in r]
        tuned = [r for r in rows if r["tile"] != "None"]
        summary = {"problems": len(rows), "tuned": len(tuned), "changed": len(changed), "compile_s": compile_s,
                   "tune_s": tune_s}
        if changed:
            gains = [r["gain"] for r in changed]
            summary |= {"gain_median": statistics.median(gains), "gain_min": min(gains), "gain_max": max(gains),
                        "mean_gain_over_tuned": (sum(gains) + len(tuned) - len(changed)) / len(tuned)}
        # After each shape, so that a run cut off by a time limit keeps what it measured.
        results.write("sparse24-tile-tuning", {"rows": rows, "summary": summary}, a.out, dtype="bf16",
                      batch=a.batch, rounds=a.rounds, top=a.top, sms=sms)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
