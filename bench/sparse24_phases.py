"""Where a small-n ``cuda_ws`` call's time goes: each CTA's phases, read from the GPU's own timer inside the kernel.

Why: at n <= 16 a 2:4 call fits ``4.9 us + held bytes / 3.14 TB/s`` on the H100 (the sweep at ebb068f), dense's
``3.2 us + bytes / 2.86 TB/s``, and the copies alone take as long as the whole kernel (docs/design/0048).  This
splits the fixed part.  The kernel built with ``KP_PROBE 3`` (``kernels/cuda/sparse24_ring.cuh``) runs as it ships
and writes, per CTA, %globaltimer at: 0 entry, 1 barriers ready (after the CTA's sync, or the cluster's where x is
multicast), 2 the ring's first stage landed, 3 the consumers past their last MMA, 4 the partial sums met (cluster
sync), 5 exit.  The ping-pong kernel (``sparse24_pp.cu``) marks 0 and 1 alike, then warpgroup 0's first tile: 2 its
first stage landed, 3 its K loop done, 4 its y stored, and 5 that warpgroup's exit (after its other tiles, if any).
Back-to-back launches in one CUDA graph, weights rotated past the L2, as the sweep times them; two y buffers
alternate, so the last two launches give the gap from one kernel's last exit to the next one's first entry.  The
build as it ships is timed beside the one with marks, so that the marks' own cost shows.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_phases.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.bench.sweep import copies_past_l2
from kernelplan.kernels import raw_stream
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels.sparse24_ws_rule import _deepest, ws_candidates, ws_config
from kernelplan.sparse24 import compress, prune
from kernelplan.timing import capture, graph_rounds
from sparse24_feed_probe import launchers

# Layers whose rule's tile at n = 1 and 16 is sparse24_ws.cu's on 132 SMs (the ping-pong kernel marks its first tile,
# the split persistent one nothing).
SHAPES = ["4608x3584", "3584x3584", "5120x5120", "8192x3584", "4096x4096", "3072x3072"]
PHASES = ("ready", "first stage", "K loop", "sums met", "y stored")
PP_PHASES = ("ready", "first stage", "K loop", "y stored", "later tiles")  # sparse24_pp.cu: warpgroup 0's tiles


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="*", default=SHAPES, metavar="MxK")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--calls", type=int, default=40, help="back-to-back launches in the graph")
    ap.add_argument("--rounds", type=int, default=5)
    twin = ap.add_mutually_exclusive_group()
    twin.add_argument("--plain", action="store_true",
                      help="where the rule's tile is ping-pong, probe the same tile one a CTA (sparse24_ws.cu)")
    twin.add_argument("--pp", action="store_true",
                      help="where the rule's tile is one a CTA and has a ping-pong twin, probe the twin "
                           "(sparse24_pp.cu)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = sm_count(0)
    rows = []
    print("us: the graph's time a call (the build without marks beside it) | the last launch: span (first entry to "
          "last exit), CTAs' entry spread, then each phase's median over the CTAs | gap: the previous launch's last "
          "exit to this one's first entry",
          flush=True)
    for shape in a.shape:
        m, k = (int(v) for v in shape.split("x"))
        w0 = prune(torch.randn(m, k, device="cuda")).bfloat16()
        copies = copies_past_l2(torch.cuda.get_device_properties(0).L2_cache_size, m * k * 9 // 8, "cold")
        ws = [w0] + [prune(torch.randn(m, k, device="cuda")).bfloat16() for _ in range(copies - 1)]
        tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
        for n in a.batch:
            cfg = ws_config(n, m, k, sms)
            if cfg.pp and a.plain:
                cfg = _deepest(cfg.bn, cfg.wm, 1, 1)
            if a.pp and not cfg.pp:
                cfg = next((c for c in ws_candidates(n, m, k) if c.pp and (c.bn, c.wm) == (cfg.bn, cfg.wm)), cfg)
            if cfg.sk:
                print(f"{m}x{k} n={n}: the rule's tile {cfg} is split persistent; sparse24_sk.cu has no marks")
                continue
            builds = launchers(cfg, n, m, {"phases": {"KP_PROBE": 3}, "shipped": {}})
            (launch, grid), shipped = builds["phases"], builds["shipped"][0]
            if cfg.pp:  # its launch takes the grid from the problem: one CTA an SM, or one a tile
                grid = launch.problem_grid(n, m)
            ctas = grid[0] * grid[1] * grid[2]
            extra = -(-ctas * 64 // (2 * m))  # rows past N that hold 8 u64 a CTA
            x = torch.randn(n, k, device="cuda").bfloat16()
            ys = [torch.zeros(n + extra, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

            def call(i, tiled=tiled, ys=ys, launch=launch):
                p, c = tiled[i % len(tiled)]
                y = ys[i % 2]
                launch(grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(), n, m, k, x.stride(0),
                              y.stride(0)), raw_stream(0))

            call(0)
            want = F.linear(x.float(), ws[0].float())
            err = float((ys[0][:n].float() - want).abs().max() / want.abs().max())
            if not err <= 2.0 ** -6:
                raise SystemExit(f"{m}x{k} n={n} {cfg}: relative error {err:.3g}")
            # The build with marks beside the build as it ships, alternating: the marks' own cost.
            per = graph_rounds({"marks": [lambda i=i: call(i) for i in range(a.calls)],
                                "shipped": [lambda i=i: call(i, launch=shipped) for i in range(a.calls)]},
                               a.calls, a.rounds)
            per_call, shipped_call = (statistics.median(per[b]) for b in ("marks", "shipped"))
            graph = torch.cuda.CUDAGraph()
            with capture(graph):
                for i in range(a.calls):
                    call(i)
            graph.replay()
            torch.cuda.synchronize()
            last, before = (ys[(a.calls - 1 - j) % 2][n:].view(torch.int64).flatten()[:ctas * 8].view(ctas, 8)
                            .double() for j in (0, 1))
            span = float(last[:, 5].max() - last[:, 0].min()) / 1e3
            spread = float(last[:, 0].max() - last[:, 0].min()) / 1e3
            gap = float(last[:, 0].min() - before[:, 5].max()) / 1e3
            names = PP_PHASES if cfg.pp else PHASES
            phases = {name: float((last[:, p + 1] - last[:, p]).median()) / 1e3 for p, name in enumerate(names)}
            row = {"m": m, "k": k, "n": n, "tile": str(cfg), "ctas": ctas, "per_call_us": per_call * 1e3,
                   "shipped_per_call_us": shipped_call * 1e3,
                   "span_us": span, "entry_spread_us": spread, "gap_us": gap, "phases_us": phases}
            rows.append(row)
            print(f"{m:6d}x{k:<6d} n={n:3d} {str(cfg)[9:-1]:<42} {ctas:4d} CTAs  call {per_call * 1e3:5.1f} "
                  f"(shipped {shipped_call * 1e3:5.1f})  span {span:5.1f}  entries {spread:4.1f}  "
                  + "  ".join(f"{nm} {v:4.2f}" for nm, v in phases.items())
                  + f"  gap {gap:4.2f}", flush=True)
        del ws, tiled
        torch.cuda.empty_cache()
        results.write("sparse24-phases", {"rows": rows}, a.out, dtype="bf16", calls=a.calls, sms=sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
