"""Write src/kernelplan/sparse24/expected.json: the committed sweeps, digested for ``kp.warmup``'s table.

Per (GPU name, dtype) it takes the L2 regime of one sweep of the sweep set: L2-cold
before L2-warm (a model's forward reads its weights from DRAM), then the one with
more batch sizes, then the newer.  Every sweep of that GPU, dtype and regime (parts
run again after a rule changed, and the LM heads' sweeps, which add their shapes)
gives its rows, oldest first, so that each (shape, n) keeps its newest reading.
Each shape keeps ``[n, graph speedup, eager speedup]`` of the rule's kernel;
``sources`` says which file and commit gave which n, oldest first.
``tests/test_readme.py`` checks the file equals this tool's output.

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
    by_key: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    for path in sorted(results.glob("sparse24-sweep-*.json")):
        doc = json.loads(path.read_text())
        by_key.setdefault((doc["device"], doc.get("dtype", "bf16")), []).append((path.name, doc))
    out = []
    for (gpu, dtype), docs in sorted(by_key.items()):
        sweep_set = [d for d in docs if d[1].get("shape_set", "sweep set") == "sweep set"]
        if not sweep_set:
            continue
        base = max(sweep_set, key=lambda d: _rank(d[1]))[1]  # its L2 regime is the table's
        # Every sweep in that regime, the LM heads' too (they add shapes), oldest first: each cell at its newest reading.
        regime = sorted((d for d in docs if d[1].get("l2") == base.get("l2")), key=lambda d: d[1].get("date", ""))
        cells: dict[tuple[str, int], list] = {}
        origin: dict[tuple[str, int], str] = {}
        for doc_name, doc in regime:
            for r in doc["rows"]:
                if "n" in r and "speedup" in r:
                    eager = r.get("eager_speedup")
                    key = (f"{r['m']}x{r['k']}", r["n"])
                    cells[key] = [r["n"], round(r["speedup"], 3), None if eager is None else round(eager, 3)]
                    origin[key] = doc_name
        sources = [{"file": doc_name, "commit": doc["commit"], "n": ns} for doc_name, doc in regime
                   if (ns := sorted({n for (_, n), o in origin.items() if o == doc_name}))]
        shapes: dict[str, list] = {}
        for (shape, _), row in cells.items():
            shapes.setdefault(shape, []).append(row)
        for rows in shapes.values():
            rows.sort()
        out.append({"gpu": gpu, "dtype": dtype, "sources": sources, "l2": base.get("l2", "warm"), "shapes": shapes})
    return {"generated_by": "tools/expected_table.py from bench/results/sparse24-sweep-*.json", "tables": out}


def text(results: Path = RESULTS) -> str:
    return json.dumps(tables(results), separators=(",", ":")) + "\n"


def main() -> int:
    OUT.write_text(text())
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
