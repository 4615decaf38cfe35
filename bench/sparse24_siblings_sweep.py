"""Grouped against separate sibling GEMMs over the sweep set: q/k/v as one GEMM or three, gate/up as one or two.

For every model of ``kernelplan.bench.shapes.MODELS`` and each n, the 2:4 layers (the rule's kernels) and dense
``F.linear``, each way, timed as CUDA graph replays (``triton.testing.do_bench_cudagraph``, median), bf16.  What
``kp.nn.fuse_siblings`` wins or loses at each n, on every model's shapes and not one.  Writes
``bench/results/sparse24-siblings-sweep-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_siblings_sweep.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.timing import graph_us
from kernelplan.bench.shapes import MODELS
from kernelplan.sparse24.format import prune_compress
from kernelplan.sparse24.gemm import linear_parts


def groups() -> dict[tuple, list[str]]:
    """(K, output rows of each member) -> the model groups that have them."""
    out: dict[tuple, list[str]] = {}
    for model in MODELS:
        q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
        out.setdefault((model.hidden, (q, kv, kv)), []).append(f"{model.name} q/k/v")
        if model.gated:
            out.setdefault((model.hidden, (model.intermediate,) * 2), []).append(f"{model.name} gate/up")
    return out



def cli() -> tuple[list[int], str | None]:
    """A sweep's arguments: the batch sizes (--n) and the results file (--out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1,16,64,256,512,2048")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    return [int(v) for v in a.n.split(",")], a.out


def summary(rows: list[dict], keys: tuple[str, ...]) -> None:
    """Per n, each key's median [min, max] over the rows."""
    for n in sorted({r["n"] for r in rows}):
        span = {key: [r[key] for r in rows if r["n"] == n] for key in keys}
        print(n, "  ".join(f"{key} {statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]" for key, v in span.items()))


def main() -> int:
    ns, out = cli()
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for (k, parts), names in groups().items():
            dense = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for m in parts]
            sparse = [prune_compress(w).packed() for w in dense]
            dense_all = torch.cat(dense)
            values, metadata = torch.cat([w.values for w in sparse]), torch.cat([w.metadata for w in sparse])
            for n in ns:
                x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                joined = linear_parts(x, values, metadata)
                alone = torch.cat([linear_parts(x, w.values, w.metadata) for w in sparse], -1)
                err = float((joined.float() - alone.float()).abs().max() / alone.float().abs().max())
                t = {"sparse_separate_us": graph_us(lambda: [linear_parts(x, w.values, w.metadata) for w in sparse]),
                     "sparse_grouped_us": graph_us(lambda: linear_parts(x, values, metadata)),
                     "dense_separate_us": graph_us(lambda: [F.linear(x, w) for w in dense]),
                     "dense_grouped_us": graph_us(lambda: F.linear(x, dense_all))}
                rows.append({"k": k, "parts": list(parts), "layers": names, "n": n, "grouped_vs_separate_err": err,
                             **t, "sparse_grouping_gain": t["sparse_separate_us"] / t["sparse_grouped_us"],
                             "dense_grouping_gain": t["dense_separate_us"] / t["dense_grouped_us"],
                             "grouped_speedup": t["dense_grouped_us"] / t["sparse_grouped_us"],
                             "separate_speedup": t["dense_separate_us"] / t["sparse_separate_us"],
                             "sparse_grouped_vs_dense_separate": t["dense_separate_us"] / t["sparse_grouped_us"]})
                print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    print("n: 2:4 grouping gain (separate / grouped) median [min, max]; dense's; 2:4 over dense, grouped and separate")
    summary(rows, ("sparse_grouping_gain", "dense_grouping_gain", "grouped_speedup", "separate_speedup"))
    results.write("sparse24-siblings-sweep", {"rows": rows}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
