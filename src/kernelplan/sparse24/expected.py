"""The speedup over dense a 2:4 layer can expect, from the sweeps measured on the same kind of GPU.

``expected.json`` (package data) is ``tools/expected_table.py``'s digest of the
committed sweep results (``bench/results/sparse24-sweep-*.json``): per GPU name
and dtype, the rule's kernel against ``F.linear`` on the sweep set's shapes, as a
CUDA graph and eagerly.  A test keeps it equal to what the tool makes of those
files.  For a shape of the table at a measured n it is that measurement; else it
is the nearest measured shape (by log M and log K), interpolated in log n
between the nearest measured n, and says so.  It is what was measured at the
table's commit, not a promise for this one: ``kernelplan bench sparse24 --sweep``
measures this build.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Expected:
    graph: float  # the rule's kernel over F.linear, as a CUDA graph
    eager: float | None  # the same, called eagerly (host work included); None where not measured
    basis: str  # "measured", or the shape it was read from: "nearest 8192x8192"
    source: str  # the results files, their commits (and n, for a part run again) and the L2 regime

    def __str__(self) -> str:
        eager = "-" if self.eager is None else f"{self.eager:.2f}x"
        mark = "" if self.basis == "measured" else "~"
        return f"{mark}{self.graph:.2f}x graph / {mark}{eager} eager"


@functools.lru_cache(maxsize=1)
def _tables() -> dict:
    text = resources.files(__package__).joinpath("expected.json").read_text()
    return {(t["gpu"], t["dtype"]): t for t in json.loads(text)["tables"]}


def gpus() -> list[tuple[str, str]]:
    """The (GPU name, dtype) pairs the table has measurements for."""
    return sorted(_tables())


def _interpolate(points: list[tuple[int, float]], n: int) -> float:
    """Linear in log2 n between the measured n around it; the end's value outside them."""
    ns = [p[0] for p in points]
    i = bisect.bisect_left(ns, n)
    if i < len(ns) and ns[i] == n:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(ns):
        return points[-1][1]
    (n0, v0), (n1, v1) = points[i - 1], points[i]
    t = (math.log2(n) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
    return v0 + t * (v1 - v0)


def expected(gpu: str, dtype: str, m: int, k: int, n: int) -> Expected | None:
    """What the sweep measured for an (M x K) weight at n rows on ``gpu`` (``torch.cuda.get_device_name``).

    None where the table has no sweep of that GPU and dtype.
    """
    table = _tables().get((gpu, dtype))
    if table is None:
        return None
    shapes = table["shapes"]
    (sm, sk), rows = min(((tuple(map(int, key.split("x"))), rows) for key, rows in shapes.items()),
                         key=lambda s: abs(math.log2(s[0][0] / m)) + abs(math.log2(s[0][1] / k)))
    graph = _interpolate([(r[0], r[1]) for r in rows], n)
    eagers = [(r[0], r[2]) for r in rows if r[2] is not None]
    eager = _interpolate(eagers, n) if eagers else None
    ns = [r[0] for r in rows]
    parts = [] if (sm, sk) == (m, k) else [f"nearest {sm}x{sk}"]
    if n not in ns:
        parts.append("n interpolated" if ns[0] < n < ns[-1] else f"n past the measured {ns[0]}-{ns[-1]}")
    basis = ", ".join(parts) or "measured"
    return Expected(graph, eager, basis, source(table))


def source(table: dict) -> str:
    """Which sweep files and commits a table's speedups come from, oldest first, each with the n it gives."""
    parts = [f"{s['file']} at {s['commit']} (n = {', '.join(map(str, s['n']))})" for s in table["sources"]]
    return "; ".join(parts) + f", L2 {table['l2']}"
