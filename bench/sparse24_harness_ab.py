"""Which difference between the tile bench and the sweep makes them read clustered tiles apart (docs/design/0055,
0056).

``tools/table_vs_sweep.py`` found the sweep's path reading K-split and x-multicast tiles 1.5-4% faster, against
dense, than ``sparse24_wg_tiles.py`` did, and single-CTA tiles alike.  The harnesses differ in how a call runs, in how
many copies of the weight it cycles over, and in how it is timed.  Here each problem's tiles (the rule's, and the
least-cost tile of each other kind) run under these factors, in one process, each beside dense under the same copies
and timer (``VARIANTS``: the call, the copies, the timer):

* ``sweep``: ``MmaLinear`` (the library's call, y allocated per call), the sweep's copies (``copies_past_l2``: past
  twice the L2 in compressed bytes), ``graph_us`` (~20 ms of calls a graph, its replays' median);
* ``lib-tilecopies``: ``MmaLinear``, the tile bench's copies (past 100 MB of dense bytes, at most 8);
* ``direct``: the tile bench's launch (``launch_config``, one y), the sweep's copies;
* ``direct-tilecopies``: the tile bench's launch and copies;
* ``tile-bench``: the same, timed as the tile bench timed until 85d7767 (``graph_ms``: a graph of
  ``calls_per_graph`` calls, replayed five times, the median).  It read K-split tiles 7% slow against ``graph_us``
  (0056); the tile bench now times with ``graph_us``;
* ``tile-bench-10x``: that timer with ten times the calls in its graph: whether the graph's length is the cause;
* ``tuner``: the direct launch on the sweep's copies, timed as opt-in tile tuning times (``timing.graph_rounds``
  with ``sparse24.tiles.calls_per_replay`` calls, five rounds, the median).

Writes ``bench/results/sparse24-harness-ab-<gpu>.json`` and prints, per kind of tile, each variant's speedup over
the sweep's.  About 20 s a problem at 2 rounds (four tiles, all variants): pass ``--shape`` for a part of the sweep
set, ``--variants`` for fewer.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_harness_ab.py \
        --batch 512 --shape 4096x4096 28672x4096 3584x3584 8192x8192
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.bench.sweep import _cycling, copies_past_l2
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.kernels.sparse24_ws_rule import rule_order, ws_candidates, ws_config
from kernelplan.sparse24 import compress, prune
from kernelplan.sparse24.dispatch import backend_for
from kernelplan.sparse24.layout import pack_reason
from kernelplan.sparse24.tiles import calls_per_replay
from kernelplan.timing import graph_rounds, graph_us
from sparse24_rule_ab import FixedTile
from sparse24_wg_tiles import calls_per_graph, direct_launch, graph_ms, weight_copies

# name: (the call, the weight copies, the timer)
VARIANTS = {"sweep": ("library", "sweep", "graph_us"), "lib-tilecopies": ("library", "tile", "graph_us"),
            "direct": ("direct", "sweep", "graph_us"), "direct-tilecopies": ("direct", "tile", "graph_us"),
            "tile-bench": ("direct", "tile", "tile-bench"), "tile-bench-10x": ("direct", "tile", "tile-bench-10x"),
            "tuner": ("direct", "sweep", "tuner")}
REPLAYS = 5  # sparse24_wg_tiles.py's old --rounds (replays of its graph a pass); tile tuning's rounds


def timers(n: int, m: int, k: int) -> dict:
    """timer name -> fn(list of calls) -> us a call."""
    calls = calls_per_graph(n, m, k)
    return {"graph_us": lambda fs: graph_us(_cycling(fs), 20),
            "tile-bench": lambda fs: 1e3 * statistics.median(graph_ms(fs, calls, REPLAYS)),
            "tile-bench-10x": lambda fs: 1e3 * statistics.median(graph_ms(fs, 10 * calls, REPLAYS)),
            "tuner": lambda fs: 1e3 * statistics.median(graph_rounds({"x": fs}, calls_per_replay(n, m, k),
                                                                     REPLAYS)["x"])}


def dense_of(variant: str) -> str:
    """The dense reading a variant's speedup is taken against: under the same copies, timed the same way."""
    _, copies, timer = VARIANTS[variant]
    return f"dense {copies} {timer}"


def tiles_of_each_kind(n: int, m: int, k: int, sms: int) -> list:
    """The rule's tile, then the least-cost tile (``rule_order``) of each other kind (``WsConfig.kind``)."""
    rule = ws_config(n, m, k, sms)
    out = {rule.kind: rule}
    for cfg in sorted(ws_candidates(n, m, k), key=lambda c: rule_order(c, n, m, k, sms)):
        out.setdefault(cfg.kind, cfg)
    return list(out.values())


def summary(rows: list[dict]) -> list[str]:
    """Per kind, each variant's speedup over dense divided by the sweep's: the median over the problems."""
    lines = []
    for kind in sorted({r["kind"] for r in rows}):
        at = [r for r in rows if r["kind"] == kind]
        timed = [v for v in VARIANTS if v != "sweep" and all(v in r["speedup"] for r in at)]
        parts = [f"{v} {statistics.median(r['speedup'][v] / r['speedup']['sweep'] for r in at):.3f}" for v in timed]
        lines.append(f"{kind} ({len(at)}): over the sweep's reading: " + ", ".join(parts))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[512])
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK", help="these (M, K) instead of the sweep set")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="these variants only (sweep, the reference, always)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    chosen = list(dict.fromkeys(["sweep", *a.variants]))
    sms, l2 = sm_count(0), torch.cuda.get_device_properties(0).L2_cache_size
    shapes = [tuple(map(int, s.split("x"))) for s in a.shape] if a.shape else list(sweep_shapes())
    rows, dtype = [], torch.bfloat16
    torch.manual_seed(0)
    kernel = WsKernel()
    with torch.inference_mode():
        for m, k in shapes:
            ns = [n for n in a.batch if backend_for((9, 0), n, m, k, "bf16") == "cuda_ws"]
            if not ns or pack_reason(m, k) is not None:  # the direct launch reads the device layout alone
                continue
            w = prune(torch.randn(m, k, device="cuda")).to(dtype)
            w24 = compress(w).packed()
            counts = {"sweep": copies_past_l2(l2, w24.values.nbytes + w24.metadata.nbytes, "cold"),
                      "tile": weight_copies(m, k)}
            dense_w = [w] + [w.clone() for _ in range(max(counts.values()) - 1)]
            for n in ns:
                x = torch.randn(n, k, device="cuda").to(dtype)
                ref = F.linear(x.double(), w.double())
                dense_lists = {c: [lambda d=d: F.linear(x, d) for d in dense_w[:counts[c]]] for c in counts}
                timer = timers(n, m, k)
                for cfg in tiles_of_each_kind(n, m, k, sms):
                    # Each tile its own copies: MmaLinear keeps a tile's launches with the weight it built them on.
                    copies = [compress(d).packed() for d in dense_w]
                    call = MmaLinear(None, FixedTile(cfg))
                    y = torch.empty(n, m, device="cuda", dtype=dtype)
                    one = direct_launch(kernel, cfg, x, y, n, m, k)

                    def direct(c, one=one, y=y):
                        one(c.values, c.metadata)
                        return y

                    way = {"library": lambda c, call=call: call(x, c.values, c.metadata, None), "direct": direct}
                    errs = {w_: float((f(copies[0]).double() - ref).abs().max() / ref.abs().max())
                            for w_, f in way.items()}
                    readings = {}
                    for v in chosen:
                        how, c_, t_ = VARIANTS[v]
                        fs = [lambda c=c, f=way[how]: f(c) for c in copies[:counts[c_]]]
                        readings[v] = lambda fs=fs, t_=t_: timer[t_](fs)
                        readings[dense_of(v)] = lambda fs=dense_lists[c_], t_=t_: timer[t_](fs)
                    times = {name: [] for name in readings}
                    for r in range(a.rounds):  # the order reversed each round: a drift lands on all alike
                        for name in list(readings) if r % 2 == 0 else list(readings)[::-1]:
                            times[name].append(readings[name]())
                    med = {name: statistics.median(t) for name, t in times.items()}
                    speedup = {v: med[dense_of(v)] / med[v] for v in chosen}
                    rows.append({"m": m, "k": k, "n": n, "tile": str(cfg), "kind": cfg.kind, "copies": counts,
                                 "us": med, "speedup": speedup, "errors": errs})
                    print(f"  {m}x{k} n={n} {cfg.kind:22s} " + " ".join(f"{v} {s:.3f}" for v, s in speedup.items())
                          + ("  WRONG" if max(errs.values()) > 2 ** -5 else ""), flush=True)
                    del copies
            torch.cuda.empty_cache()
            # After each shape: a run cut off by a time limit keeps what it timed.
            results.write("sparse24-harness-ab", {"rows": rows}, a.out, dtype="bf16", sms=sms, rounds=a.rounds)
    print("\n".join(summary(rows)))
    return 1 if any(max(r["errors"].values()) > 2 ** -5 for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
