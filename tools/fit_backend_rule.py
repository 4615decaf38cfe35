"""Reads sweeps (``bench/results/sparse24-sweep-*.json``, from ``kernelplan bench sparse24 --sweep``) for the Hopper
boundary between ``cuda_sp`` and ``cuda_ws`` at n <= 16 (``sparse24/dispatch.py``: ``backend_for``).

A sweep row times both backends' rule tiles beside dense in one process (``cuda_sp_ms``, ``cuda_ws_ms``).  Prints, per
sweep:

* by kind of weight (``kind``) and n: ``cuda_sp``'s speed over ``cuda_ws``'s, as a geometric mean and range, and on how
  many rows ``cuda_sp`` was the faster;
* with ``--tall-min-k K``: the rows whose backend moves if tall weights took ``cuda_sp`` from K columns on instead of
  ``SP_TALL_MIN_K``, and each moved row's time under K over its time under today's bound (geometric mean, range, and
  how many rows today's bound runs slower).

Docs: docs/design/0060.

    python tools/fit_backend_rule.py --tall-min-k 0 bench/results/sparse24-sweep-uneven-k-small-n-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fit_sp_rule import geomean  # noqa: E402
from kernelplan.sparse24 import dispatch  # noqa: E402

HOPPER = (9, 0)


def kind(m: int, k: int) -> str:
    """The weight's kind in ``backend_for``'s terms (its K bound on tall weights aside)."""
    if m >= dispatch.SP_MIN_M_HOPPER:
        return "tall"
    if dispatch.wide_weight(m, k):
        return "wide, few rows" if m > dispatch.SP_WIDE_MIN_M else "wide, fewest rows"
    return "other"


def timed_rows(doc: dict) -> list[dict]:
    """The rows at n <= 16 that timed both backends."""
    return [r for r in doc["rows"] if r.get("n", 17) <= 16 and "cuda_sp_ms" in r and "cuda_ws_ms" in r]


def by_kind(rows: list[dict]) -> dict[tuple[str, int], list[float]]:
    """``(kind, n)``: each row's cuda_sp speed over cuda_ws's (above 1: cuda_sp the faster)."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        out.setdefault((kind(r["m"], r["k"]), r["n"]), []).append(r["cuda_ws_ms"] / r["cuda_sp_ms"])
    return out


def tall_min_k(k: int):
    """``backend_for`` with tall weights taking cuda_sp from ``k`` columns on (a context)."""
    return mock.patch.object(dispatch, "SP_TALL_MIN_K", k)


def moves(rows: list[dict], k: int) -> list[tuple[float, int, int, int]]:
    """``(time under the bound k over time under today's, m, K, n)`` of each row whose backend the bound moves."""
    today = {id(r): dispatch.backend_for(HOPPER, r["n"], r["m"], r["k"], "bf16") for r in rows}
    with tall_min_k(k):
        other = {id(r): dispatch.backend_for(HOPPER, r["n"], r["m"], r["k"], "bf16") for r in rows}
    return [(r[f"{other[id(r)]}_ms"] / r[f"{today[id(r)]}_ms"], r["m"], r["k"], r["n"])
            for r in rows if other[id(r)] != today[id(r)]]


def report(path: str, k: int | None) -> list[str]:
    doc = json.loads(Path(path).read_text())
    rows = timed_rows(doc)
    lines = [f"{Path(path).name} ({doc.get('device')}, {doc.get('dtype', 'bf16')}, {doc.get('commit')}): "
             f"{len(rows)} rows at n <= 16 with both backends timed"]
    for (what, n), ratios in sorted(by_kind(rows).items()):
        lines.append(f"  {what:<17} n = {n:<2}  {len(ratios):3d} rows  cuda_sp over cuda_ws: {geomean(ratios):.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f}), cuda_sp faster on {sum(x > 1 for x in ratios)}")
    if k is not None:
        moved = moves(rows, k)
        if moved:
            times = [t for t, *_ in moved]
            lines.append(f"  tall weights take cuda_sp from K = {k} on: {len(moved)} rows move; their time over "
                         f"today's {geomean(times):.3f} ({min(times):.3f}-{max(times):.3f}), today's slower on "
                         f"{sum(t < 1 for t in times)}")
        else:
            lines.append(f"  tall weights take cuda_sp from K = {k} on: no row moves")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--tall-min-k", type=int, default=None, help="also the moves of this bound on tall weights' K")
    a = ap.parse_args(argv)
    for path in a.sweeps:
        print("\n".join(report(path, a.tall_min_k)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
