"""Write src/kernelplan/sparse24/expected.json: the committed sweeps, digested for ``kp.warmup``'s table.

Per (GPU name, dtype) it takes one sweep of the sweep set: L2-cold before
L2-warm (a model's forward reads its weights from DRAM), then the one with more
batch sizes, then the newer.  Newer sweeps of the same GPU, dtype and L2 regime
over fewer batch sizes (a part run again after a rule changed) replace its rows
at the n they timed.  Sweeps of the LM heads (``--lm-heads``) in that regime add
their shapes.  Each shape keeps ``[n, graph speedup, eager speedup]`` of the rule's
kernel; ``sources`` says which file and commit gave which n.
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
        name, base = max(sweep_set, key=lambda d: _rank(d[1]))
        newer = sorted((d for d in sweep_set if d[1].get("l2") == base.get("l2")
                        and d[1].get("date", "") > base.get("date", "")), key=lambda d: d[1]["date"])
        # Sweeps of other shapes (the LM heads) add their shapes, in the base's L2 regime, whatever their date.
        newer += sorted((d for d in docs if d not in sweep_set and d[1].get("l2") == base.get("l2")),
                        key=lambda d: d[1]["date"])
        sources = [{"file": name, "commit": base["commit"], "n": None}]
        cells: dict[tuple[str, int], list] = {}
        for doc_name, doc in [(name, base), *newer]:
            ns = sorted({r["n"] for r in doc["rows"] if "n" in r and "speedup" in r})
            if doc is not base:
                sources.append({"file": doc_name, "commit": doc["commit"], "n": ns})
            for r in doc["rows"]:
                if "n" in r and "speedup" in r:
                    eager = r.get("eager_speedup")
                    cells[(f"{r['m']}x{r['k']}", r["n"])] = [r["n"], round(r["speedup"], 3),
                                                            None if eager is None else round(eager, 3)]
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
