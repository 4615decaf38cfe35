"""The n <= 16 calls' time as a fixed part plus bytes over a rate: a least-squares line over a committed sweep.

Reads ``bench/results/sparse24-sweep-small-n-*.json`` (no GPU).  For each file and n it fits, over the layers of
``--min-mb`` to ``--max-mb`` dense MB, the rule's 2:4 time (CUDA graph) against the bytes its weight holds
(0.5625 x dense's), and dense's time against dense's bytes: ``time = F + bytes / BW``, with the residuals' standard
deviation.  Then, for layer sizes, the speedup 1.5x would need and the fixed part it leaves the 2:4 call at the
fitted rate (docs/design/0048).

    python tools/small_n_fit.py [bench/results/sparse24-sweep-small-n-h100.json ...] [--n 1 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
HELD = 9 / 16  # the one layout's bytes over dense's


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(intercept, slope, residual sd) of the least-squares line through ``points`` (x, y)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return intercept, slope, statistics.pstdev(y - (intercept + slope * x) for x, y in points)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path,
                    default=[RESULTS / "sparse24-sweep-small-n-h100.json", RESULTS / "sparse24-sweep-small-n-h200.json"])
    ap.add_argument("--n", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--min-mb", type=float, default=16.0)
    ap.add_argument("--max-mb", type=float, default=120.0)
    ap.add_argument("--target", type=float, default=1.5)
    a = ap.parse_args()
    for path in a.files:
        doc = json.loads(path.read_text())
        for n in a.n:
            rows = [r for r in doc["rows"] if r.get("n") == n and "speedup" in r
                    and a.min_mb <= 2 * r["m"] * r["k"] / 1e6 < a.max_mb]
            if len(rows) < 3:
                print(f"{path.name} n = {n}: {len(rows)} rows in range, too few to fit")
                continue
            dense_bytes = [2 * r["m"] * r["k"] for r in rows]
            f_d, s_d, sd_d = fit([(b, r["dense_ms"] * 1e3) for b, r in zip(dense_bytes, rows)])
            f_s, s_s, sd_s = fit([(HELD * b, r["dense_ms"] / r["speedup"] * 1e3) for b, r in zip(dense_bytes, rows)])
            print(f"{path.name} ({doc['device']} at {doc['commit']}), n = {n}, {len(rows)} layers of "
                  f"{a.min_mb:g}-{a.max_mb:g} MB:")
            print(f"  2:4   {f_s:5.2f} us + held bytes / {1e-6 / s_s:5.2f} TB/s  (residual sd {sd_s:.2f} us)")
            print(f"  dense {f_d:5.2f} us + bytes / {1e-6 / s_d:5.2f} TB/s  (residual sd {sd_d:.2f} us)")
            for mb in (19, 26, 33, 38, 52):
                dense_us = f_d + mb * 1e6 * s_d
                allowed = dense_us / a.target - HELD * mb * 1e6 * s_s
                print(f"  {mb:3d} MB: dense {dense_us:5.1f} us; {a.target}x leaves the 2:4 call {allowed:5.2f} us of "
                      f"fixed part at its rate (fitted: {f_s:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
