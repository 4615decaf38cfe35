"""Why a GPU-bound 2:4 call can run slower eagerly than replayed in a CUDA graph, where dense does not.

The quick sweeps read the rule's kernel 5-26% slower eagerly (``rule_eager_ms``) than
as a graph (``dense_ms / speedup``) on layers whose kernels take 50-170 us, where
the host is far ahead and host work cannot be the cause; dense read 0.86-1.1x.
For each layer and n, alternating, medians of rounds:

* ``graph``: ``triton.testing.do_bench_cudagraph`` (as the sweep's kernel time);
* ``events``: CUDA events around back-to-back eager calls (device time a call, host ahead);
* ``kernel``: the kernels' own durations under ``torch.profiler`` (CUPTI), eager.

for ``F.linear``, ``kp.sparse24.linear`` and the cuda_ws kernel called directly
(``MmaLinear``, as the sweep's graph path calls it).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_eager_gap.py \
        [--shape MxKxN ...] [--wall]

``--wall`` instead takes the sweep's eager reading as the sweep takes it (weights rotated past L2, wall per call
of 50 back-to-back calls) beside CUDA events over the same calls and CUPTI's kernel durations and the gaps between
kernels, for F.linear and ``kp.sparse24.linear``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_ws import WsKernel
from kernelplan.timing import by_short_name, kernel_device_ms

SHAPES = ("4608x36864x256", "5120x17920x256", "16384x3072x256", "8192x8192x256", "4096x14336x256",
          "4096x4096x4096")


def events_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _kernel_events(prof) -> list[dict]:
    """The CUDA kernels of a ``torch.profiler`` trace (CUPTI's), in start order: each with ``ts``, ``dur``, ``name``."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def _rotated_problem(shape: str, dev, l2: int):
    """``MxKxN``: (m, k, n, dense weights, their 2:4 weights in the device layout, x), as many copies of the weight
    as take reads of it past L2 (the sweep's L2-cold rotation)."""
    from kernelplan.bench.sweep import copies_past_l2

    m, k, n = map(int, shape.split("x"))
    w = kp.sparse24.prune(torch.randn(m, k, device=dev)).bfloat16()
    w24 = kp.sparse24.compress(w).packed()
    copies = copies_past_l2(l2, w24.values.nbytes + w24.metadata.nbytes, "cold")
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    w24s = [w24] + [kp.sparse24.compress(c).packed() for c in ws[1:]]
    return m, k, n, ws, w24s, torch.randn(n, k, device=dev).bfloat16()


def kernel_trace(fn, calls: int) -> dict:
    """CUPTI's view of ``calls`` back-to-back eager calls (``torch.profiler``'s trace): the median kernel duration
    and the median idle gap between one kernel's end and the next one's start, in us."""
    from kernelplan.timing import profiled_calls

    kernels = [(e["ts"], e["dur"]) for e in _kernel_events(profiled_calls(fn, calls))]
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(kernels, kernels[1:])]
    return {"kernels": len(kernels), "kernel_us": statistics.median(d for _, d in kernels),
            "gap_us": statistics.median(gaps) if gaps else float("nan")}


def wall_study(shapes, rounds: int, calls: int) -> list[dict]:
    """The sweep's eager reading (weights rotated past L2, wall per call of back-to-back calls, F.linear and
    ``kp.sparse24.linear`` paired in a round) beside CUDA events over the same calls and CUPTI's kernel durations
    and gaps: is a slow eager reading the kernel or the space between kernels?"""
    from kernelplan.bench.sweep import _cycling
    from kernelplan.timing import host_us_per_call

    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for s in shapes:
        m, k, n, ws, w24s, x = _rotated_problem(s, dev, l2)
        sparse = _cycling([lambda c=c: kp.sparse24.linear(x, c) for c in w24s])
        fns = {"dense": _cycling([lambda c=c: F.linear(x, c) for c in ws]), "sparse": sparse, "sparse_side": sparse}
        # "sparse_side": the same calls on a side stream, as do_bench_cudagraph runs them, not the default stream.
        side = torch.cuda.Stream()
        where = {name: (lambda: torch.cuda.stream(side)) if name.endswith("_side") else contextlib.nullcontext
                 for name in fns}
        reads = {name: {"graph": [], "wall": [], "events": []} for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                reads[name]["graph"].append(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
                with where[name]():
                    reads[name]["wall"].append(host_us_per_call(fn, dev, calls) / 1e3)
                    reads[name]["events"].append(events_ms(fn, calls))
        row = {"m": m, "k": k, "n": n, "weight_copies": len(ws), "calls": calls}
        for name, fn in fns.items():
            row[name] = {key: statistics.median(v) for key, v in reads[name].items()}
            with where[name]():
                row[name]["trace"] = kernel_trace(fn, calls)
        for key in ("graph", "wall", "events"):
            row[f"{key}_speedup"] = row["dense"][key] / row["sparse"][key]
        rows.append(row)
        print(f"{m}x{k} n={n} copies={len(ws)} calls={calls}: speedup graph {row['graph_speedup']:.2f}x, wall "
              f"{row['wall_speedup']:.2f}x, events {row['events_speedup']:.2f}x", flush=True)
        for name in fns:
            r = row[name]
            print(f"    {name:>6}: graph {r['graph'] * 1e3:.1f}  wall {r['wall'] * 1e3:.1f}  events "
                  f"{r['events'] * 1e3:.1f} us;  CUPTI: {r['trace']['kernels']} kernels of "
                  f"{r['trace']['kernel_us']:.1f} us, gaps {r['trace']['gap_us']:.1f} us", flush=True)
        del ws, w24s
        torch.cuda.empty_cache()
    return rows


class ClockSampler:
    """The SM clock and the clock-event (throttle) reasons, read through NVML (``cuda.bindings.nvml``) every
    millisecond in a thread; ``during(t0, t1)`` gives the median MHz and the reasons seen between two
    ``time.perf_counter()`` readings.  Reads nothing (NaN) where NVML is not there."""

    def __init__(self):
        import threading

        self.samples, self.stop_flag = [], False
        try:
            from cuda.bindings import nvml

            nvml.init_v2()
            handle = nvml.device_get_handle_by_index_v2(torch.cuda.current_device())
            self.read = lambda: (nvml.device_get_clock_info(handle, nvml.ClockType.CLOCK_SM),
                                 int(nvml.device_get_current_clocks_event_reasons(handle)))
            self.read()
        except Exception as e:  # the study runs on without clocks, and says so
            print(f"no NVML clocks: {e!r}")
            self.read = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_flag and self.read:
            self.samples.append((time.perf_counter(), *self.read()))
            time.sleep(0.001)

    def stop(self) -> None:
        self.stop_flag = True
        self.thread.join()

    def during(self, t0: float, t1: float) -> tuple[float, int]:
        inside = [(mhz, why) for t, mhz, why in self.samples if t0 <= t <= t1]
        reasons = 0
        for _, why in inside:
            reasons |= why
        return (statistics.median(m for m, _ in inside) if inside else float("nan")), reasons


def sequence_study(shapes, calls: int, blocks: int = 6) -> list[dict]:
    """Blocks of ``calls`` eager calls, each timed by CUDA events and CUPTI's kernel durations, with the SM clock
    during it: dense and 2:4 alternating (as the sweep's eager rounds run them), then 2:4 alone.  Is a 2:4 block
    slower after dense's, and is it the clock?"""
    from torch.profiler import ProfilerActivity, profile

    from kernelplan.bench.sweep import _cycling

    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for s in shapes:
        m, k, n, ws, w24s, x = _rotated_problem(s, dev, l2)
        fns = {"dense": _cycling([lambda c=c: F.linear(x, c) for c in ws]),
               "sparse": _cycling([lambda c=c: kp.sparse24.linear(x, c) for c in w24s])}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fns["sparse"]()
        one_call = {"dense": fns["dense"], "sparse": fns["sparse"]}
        for pattern in ("alternating", "sparse alone", "sparse graph"):
            order = [("dense", "sparse")[i % 2] if pattern == "alternating" else "sparse" for i in range(blocks)]
            time.sleep(0.5)  # idle between patterns, so that the second does not start in the first's state
            clocks = ClockSampler()
            windows = []
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for name in order:
                    t0 = time.perf_counter()
                    if pattern == "sparse graph":
                        graph.replay()
                    else:
                        for _ in range(calls):
                            one_call[name]()
                    torch.cuda.synchronize()
                    windows.append((t0, time.perf_counter()))
            clocks.stop()
            kernels = [(e["ts"], e["dur"], e["name"]) for e in _kernel_events(prof)]
            out, i = [], 0
            for name, (t0, t1) in zip(order, windows):
                # A block's kernels: dense launches one or two a call (split K and its reduction).
                per_call = 1 if name == "sparse" else (len(kernels) - calls * order.count("sparse")) // (
                    calls * order.count("dense"))
                block = kernels[i: i + calls * per_call]
                i += calls * per_call
                mhz, why = clocks.during(t0, t1)
                out.append({"kind": name, "wall_us_per_call": (t1 - t0) / calls * 1e6,
                            "device_us_per_call": sum(d for _, d, _ in block) / calls,
                            "first_call_us": sum(d for _, d, _ in block[:per_call]),
                            "last_call_us": sum(d for _, d, _ in block[-per_call:]), "mhz": mhz,
                            "clock_event_reasons": hex(why)})
            rows.append({"m": m, "k": k, "n": n, "calls": calls, "pattern": pattern, "blocks": out})
            print(f"{m}x{k} n={n} {pattern}: " + "; ".join(
                f"{b['kind']} {b['device_us_per_call']:.1f} us ({b['first_call_us']:.0f}->{b['last_call_us']:.0f}) "
                f"{b['mhz']:.0f} MHz {b['clock_event_reasons']}" for b in out), flush=True)
        del ws, w24s
        torch.cuda.empty_cache()
    return rows


def tile_sequence_study(shapes, calls: int, top: int, blocks: int = 6) -> list[dict]:
    """Per layer, the rule's tile, the first 192-row tile and the ``top`` first others in the rule's order that are
    not ping-pong, each launched directly
    (no host work beside the launch) in blocks of ``calls`` calls alternating with dense ``F.linear``'s, as the
    sweep's eager rounds alternate: the first 2:4 block's time and the last's (CUPTI), by tile."""
    from torch.profiler import ProfilerActivity, profile

    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_sp import _tiled
    from kernelplan.kernels.sparse24_ws import _launcher
    from kernelplan.kernels.sparse24_ws_rule import rule_order, tile_cost, ws_candidates, ws_config

    dev = torch.device("cuda")
    sms = sm_count(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    kernel = WsKernel()
    rows = []
    for s in shapes:
        m, k, n, ws, w24s, x = _rotated_problem(s, dev, l2)
        w = ws[0]
        tiled = [_tiled(c.values, c.metadata) for c in w24s]
        y = torch.empty(n, m, device=dev, dtype=torch.bfloat16)
        want = F.linear(x, w).float()
        rule = ws_config(n, m, k, sms)
        ranked = [c for c in sorted(ws_candidates(n, m, k), key=lambda c: rule_order(c, n, m, k, sms))
                  if not c.pp and c != rule]
        others = [c for c in ranked if c.wm == 3][:1] + [c for c in ranked if c.wm < 3][:top]
        for cfg in [rule] + others:
            _launcher(cfg, "bf16", False, None, 0)
            launch, grid = kernel.launch_config(cfg, n, m, "bf16", False, None, 0)
            fs = [lambda p=p, c=c: launch(grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(),
                                                 n, m, k, x.stride(0), y.stride(0)), raw_stream(0))
                  for p, c in tiled]
            fs[0]()
            err = float((y.float() - want).abs().max() / want.abs().max())
            turn = {"dense": 0, "sparse": 0}

            def call(name):
                i = turn[name] = turn[name] + 1
                return F.linear(x, ws[i % len(ws)]) if name == "dense" else fs[i % len(fs)]()

            graph = triton.testing.do_bench_cudagraph(lambda: call("sparse"), rep=20, return_mode="median")
            time.sleep(0.5)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for b in range(blocks):
                    for _ in range(calls):
                        call(("dense", "sparse")[b % 2])
                torch.cuda.synchronize()
            durs = [e["dur"] for e in _kernel_events(prof) if e["name"].startswith("kp_sparse24")]
            per_block = [statistics.median(durs[i: i + calls]) for i in range(0, len(durs), calls)]
            row = {"m": m, "k": k, "n": n, "config": str(cfg), "rule": cfg == rule, "cost": tile_cost(cfg, n, m, k, sms),
                   "err": err, "graph_us": graph * 1e3, "alternating_block_us": per_block}
            rows.append(row)
            print(f"{m}x{k} n={n} {'rule ' if cfg == rule else '     '}{str(cfg)[8:-1]:<52} cost {row['cost']:8.0f} "
                  f"err {err:.1e} graph {graph * 1e3:6.1f} us; 2:4 blocks after dense: "
                  + " ".join(f"{t:.1f}" for t in per_block), flush=True)
        del w, ws, w24s, tiled
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="*", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--wall", action="store_true", help="the sweep's eager reading beside events and CUPTI's")
    ap.add_argument("--sequence", action="store_true", help="CUPTI over dense and 2:4 blocks alternating")
    ap.add_argument("--tiles", type=int, default=0, help="the rule's tile and this many others, alternating")
    ap.add_argument("--calls", type=int, nargs="*", default=[50], help="--wall: calls a reading")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.tiles:
        rows = [r for calls in a.calls for r in tile_sequence_study(a.shape, calls, a.tiles)]
        results.write("sparse24-eager-tiles", {"rows": rows}, a.json)
        return 0
    if a.sequence:
        rows = [r for calls in a.calls for r in sequence_study(a.shape, calls)]
        results.write("sparse24-eager-sequence", {"rows": rows}, a.json)
        return 0
    if a.wall:
        rows = [r for calls in a.calls for r in wall_study(a.shape, a.rounds, calls)]
        results.write("sparse24-eager-wall", {"rows": rows}, a.json)
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = []
    for s in a.shape:
        m, k, n = map(int, s.split("x"))
        w = kp.sparse24.prune(torch.randn(m, k, device=dev)).bfloat16()
        w24 = kp.sparse24.compress(w).packed()
        x = torch.randn(n, k, device=dev).bfloat16()
        direct = MmaLinear(None, WsKernel())
        fns = {"dense": lambda: F.linear(x, w), "linear": lambda: kp.sparse24.linear(x, w24),
               "direct": lambda: direct(x, w24.values, w24.metadata, None)}
        ref = F.linear(x.double(), w.double())
        errs = {name: float((fn().double() - ref).norm() / ref.norm()) for name, fn in fns.items()}
        reads = {name: {"graph": [], "events": []} for name in fns}
        for _ in range(a.rounds):
            for name, fn in fns.items():
                reads[name]["graph"].append(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
                reads[name]["events"].append(events_ms(fn))
        row = {"m": m, "k": k, "n": n, "errors": errs}
        for name, fn in fns.items():
            row[name] = {key: statistics.median(v) for key, v in reads[name].items()}
            row[name]["kernels"] = by_short_name(kernel_device_ms(fn, 20), 60)
        rows.append(row)
        print(f"{m}x{k} n={n}: " + "  ".join(
            f"{name} graph {row[name]['graph'] * 1e3:.1f} events {row[name]['events'] * 1e3:.1f} us"
            for name in fns), flush=True)
        for name in fns:
            print(f"    {name} kernels: " + "; ".join(f"{kn} {t * 1e3:.1f} us" for kn, t in row[name]["kernels"].items()))
    results.write("sparse24-eager-gap", {"rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
