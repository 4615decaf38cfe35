"""A feed-probe A/B by kind of tile: each variant build's time over the kernel as it ships, geometric means.

Reads one ``bench/results/*.json`` that ``bench/sparse24_feed_probe.py --define ...`` wrote (no GPU).  Its problems
are grouped by the rule's tile (ping-pong, or the cluster: CM x KC) and by the layer's dense bytes (16 MB and more,
the n <= 16 target's layers, or fewer); for each variant build (``full_NAME=VALUE``) the table gives the geometric
mean of variant time over shipped time, and its range.  Over 1 the shipped build is the faster.  The ping-pong rows
are the control where a switch only reaches ``sparse24_ws.cu`` (docs/design/0049).

    python tools/ab_table.py bench/results/sparse24-local-sync-h100.json [--over full_KP_EARLY_FILL=0]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

BIG = 16_000_000  # dense bytes from which a layer is one of the n <= 16 target's (1.5x; 0039 counts 105 such rows)


def kind(row: dict) -> str:
    """The row's tile kind: "ping-pong", or "CM x KC" and whether its layer is 16 MB or more."""
    tile = row["tile"]
    if "pp=True" in tile:
        return "ping-pong"
    cm, kc = (int(re.search(rf"{f}=(\d+)", tile).group(1)) for f in ("cm", "kc"))
    size = ">= 16 MB" if 2 * row["m"] * row["k"] >= BIG else "< 16 MB"
    return f"cm {cm} x kc {kc}, {size}"


def table(rows: list[dict], over: str = "full") -> list[tuple[str, str, int, float, float, float]]:
    """(kind, variant, problems, geometric mean, min, max) of each variant's time over ``over``'s, by kind."""
    variants = list(dict.fromkeys(m for r in rows for m in r["ms"] if m.startswith("full") and m != over))
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(kind(row), []).append(row)
    out = []
    for name in sorted(groups):
        for v in variants:  # a build a tile cannot take (a switch's static_assert) is missing from its rows
            ratios = [r["ms"][v] / r["ms"][over] for r in groups[name] if v in r["ms"] and over in r["ms"]]
            if ratios:
                gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                out.append((name, v, len(ratios), gm, min(ratios), max(ratios)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("--over", default="full", help="the build the others are divided by (default: as it ships)")
    a = ap.parse_args()
    doc = json.loads(a.file.read_text())
    meta = doc.get("meta", {})
    print(f"{a.file.name}: {meta.get('device')} at {meta.get('commit')}; time over {a.over}'s")
    for name, v, count, gm, lo, hi in table(doc["rows"], a.over):
        print(f"  {name:<24} {v[5:] or 'full':<40} {count:3d}  {gm:.3f} ({lo:.3f}-{hi:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
