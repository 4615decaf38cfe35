"""Write src/kernelplan/sparse24/expected.json: the committed sweeps, digested for ``kp.warmup``'s table.

Per (GPU name, dtype) it takes one sweep: L2-cold before L2-warm (a model's
forward reads its weights from DRAM), then the one with more batch sizes, then
the newer.  Each shape keeps ``[n, graph speedup, eager speedup]`` of the rule's
kernel.  ``tests/test_readme.py`` checks the file equals this tool's output.

    python tools/expected_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "src" / "kernelplan" / "sparse24" / "expected.json"


def _rank(doc: dict) -> tuple:
    return (doc.get("l2") == "cold", len(doc.get("batch_sizes", [])), doc.get("date", ""))


def tables(results: Path = RESULTS) -> dict:
    chosen: dict[tuple[str, str], tuple[str, dict]] = {}
    for path in sorted(results.glob("sparse24-sweep-*.json")):
        doc = json.loads(path.read_text())
        key = (doc["device"], doc.get("dtype", "bf16"))
        if key not in chosen or _rank(doc) > _rank(chosen[key][1]):
            chosen[key] = (path.name, doc)
    out = []
    for (gpu, dtype), (name, doc) in sorted(chosen.items()):
        shapes: dict[str, list] = {}
        for r in doc["rows"]:
            if "n" in r and "speedup" in r:
                eager = r.get("eager_speedup")
                shapes.setdefault(f"{r['m']}x{r['k']}", []).append(
                    [r["n"], round(r["speedup"], 3), None if eager is None else round(eager, 3)])
        for rows in shapes.values():
            rows.sort()
        out.append({"gpu": gpu, "dtype": dtype, "source": name, "commit": doc["commit"],
                    "l2": doc.get("l2", "warm"), "shapes": shapes})
    return {"generated_by": "tools/expected_table.py from bench/results/sparse24-sweep-*.json", "tables": out}


def text(results: Path = RESULTS) -> str:
    return json.dumps(tables(results), separators=(",", ":")) + "\n"


def main() -> int:
    OUT.write_text(text())
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
