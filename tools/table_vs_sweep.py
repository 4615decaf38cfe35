"""How a tile table's readings compare with the sweeps', tile for tile, by kind of tile (docs/design/0055).

A tile table (``bench/sparse24_wg_tiles.py --kernel ws``) times each tile beside dense through direct launches; a
sweep (``kernelplan bench sparse24 --sweep``) times the rule's tile beside dense through the library's path.  Where
both timed the same tile on the same problem, the sweep's speedup over the table's says how the two harnesses differ.
Run-to-run drift moves every kind alike; a kind that moves apart from the others is a bias of one harness, which the
rule's fit (on tile tables) inherits.

    python tools/table_vs_sweep.py --tables bench/results/sparse24-ws-top8-pushed-h200.json \
        --sweeps bench/results/sparse24-sweep-h200.json bench/results/sparse24-sweep-unicast-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fit_ws_rule import ws_tile  # noqa: E402


def speedups(paths: list[str], sweep: bool) -> dict[tuple[int, int, int, str], float]:
    """(M, K, n, tile) -> dense's time over the tile's, the later file's where two timed it."""
    out = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            if sweep and r.get("rule") == "cuda_ws" and r.get("ws_config") and "speedup" in r:
                out[(r["m"], r["k"], r["n"], r["ws_config"])] = r["speedup"]
            for tile, ms in ({} if sweep else r.get("tiles_ms", {})).items():
                if tile.startswith("WsConfig"):
                    out[(r["m"], r["k"], r["n"], tile)] = r["dense_ms"] / ms
    return out


def by_kind(tables: list[str], sweeps: list[str]) -> dict[str, list[float]]:
    """Per kind of tile, the sweep's speedup over the table's on each problem and tile both timed."""
    table, sweep = speedups(tables, False), speedups(sweeps, True)
    out: dict[str, list[float]] = {}
    for key, s in sweep.items():
        if key in table:
            out.setdefault(ws_tile(key[3]).kind, []).append(s / table[key])
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tables", nargs="+", required=True)
    ap.add_argument("--sweeps", nargs="+", required=True)
    a = ap.parse_args(argv)
    for name, ratios in sorted(by_kind(a.tables, a.sweeps).items()):
        print(f"{name}: {len(ratios)} problems, the sweep's speedup over the table's: median "
              f"{statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
