"""The device runtime's cost (kernelplan.runtime): round trips of a tiny request, and a 2:4 linear through it.

* ``--device cpu``: a ``FaultRequest("none")`` (the worker replies at once) one at a
  time, and pipelined 64 deep (64 sent, then all waited for); medians of rounds,
  per request.
* ``--device cuda[:i]``: also a 2:4 linear at n = 16 on a 70B shape (8192 x 8192,
  bf16): calls per second of the plan run directly in this process against the
  same request through the runtime, sent whole (one request object, as a loop on
  fixed buffers sends it), prepared (``Runtime.prepare``), and a new request
  object on the same buffers each call, pipelined (64 in flight), alternating rounds.

Writes ``bench/results/runtime-<cpu|gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/runtime_latency.py --device cpu
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import statistics
import sys
import time

import torch

from kernelplan.bench import environment
from kernelplan.runtime import FaultRequest, Runtime, Sparse24LinearRequest


def _echo(conn) -> None:
    while (msg := conn.recv()) is not None:
        conn.send(msg)


def raw_pipe_us(calls: int, depth: int = 64) -> tuple[float, float]:
    """The floor under the runtime: a bare spawn-context pipe to an echo process, one message at a time and 64
    deep (what the runtime adds is its reader thread, futures and request objects)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(b,), daemon=True)
    proc.start()
    msg = ("run", 1, FaultRequest("none"))
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        a.send(msg)
        a.recv()
        samples.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(calls // depth):
        for _ in range(depth):
            a.send(msg)
        for _ in range(depth):
            a.recv()
    piped = (time.perf_counter() - t0) / (calls // depth * depth)
    a.send(None)
    proc.join()
    return statistics.median(samples) * 1e6, piped * 1e6


def one_at_a_time_us(rt, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rt.blocking.run(FaultRequest("none"))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def pipelined_us(rt, submit, depth: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        futures = [submit() for _ in range(depth)]
        concurrent.futures.wait(futures)
        samples.append((time.perf_counter() - t0) / depth)
        for f in futures:
            f.result()
    return statistics.median(samples) * 1e6


def streamed_per_s(submit, calls: int, window: int) -> float:
    """Calls per second with at most ``window`` in flight."""
    inflight: collections.deque = collections.deque()
    t0 = time.perf_counter()
    for _ in range(calls):
        if len(inflight) >= window:
            inflight.popleft().result()
        inflight.append(submit())
    for f in inflight:
        f.result()
    return calls / (time.perf_counter() - t0)


def sparse24_through_runtime(device: str, rounds: int) -> dict:
    from kernelplan.sparse24 import compress, prune
    from kernelplan.sparse24.gemm import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    n, m, k = 16, 8192, 8192
    w = compress(prune(torch.randn(m, k, device=device)).to(torch.bfloat16))
    x = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    y = torch.empty(n, m, device=device, dtype=torch.bfloat16)
    desc = GemmSparse24Descriptor(n=n, m=m, k=k, dtype="bf16", device=device)
    plan = GemmSparse24Plan.select(desc)
    args = GemmSparse24Args(x, w.values, w.metadata, y)

    def direct_per_s(calls: int) -> float:
        plan.run(args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            plan.run(args)
        torch.cuda.synchronize()
        return calls / (time.perf_counter() - t0)

    with Runtime(devices=(device,)) as rt:
        b = rt.blocking
        request = Sparse24LinearRequest(desc, GemmSparse24Args(b.upload(x), b.upload(w.values), b.upload(w.metadata),
                                                               b.upload(y)))
        got = b.run(request)
        check = float((b.download(request.args.y).to(device).float() - (plan.run(args) or y).float()).abs().max())
        prepared = b.prepare(request)
        direct, through, kept, rebuilt = [], [], [], []
        for _ in range(rounds):
            direct.append(direct_per_s(2000))
            through.append(streamed_per_s(lambda: rt.submit_run(request), 2000, 64))
            kept.append(streamed_per_s(lambda: rt.submit_run_prepared(prepared), 2000, 64))
            # a new request object each call, on the same buffers: pickled each time, bound once by the worker
            rebuilt.append(streamed_per_s(lambda: rt.submit_run(Sparse24LinearRequest(desc, request.args)), 2000, 64))
    return {"shape": [n, m, k], "dtype": "bf16", "backend": got.sku.backend, "kernel_ms": got.kernel_ms,
            "max_abs_diff_vs_direct": check, "direct_calls_per_s": statistics.median(direct),
            "runtime_calls_per_s": statistics.median(through),
            "runtime_over_direct": statistics.median(through) / statistics.median(direct),
            "prepared_calls_per_s": statistics.median(kept),
            "prepared_over_direct": statistics.median(kept) / statistics.median(direct),
            "rebuilt_calls_per_s": statistics.median(rebuilt),
            "rebuilt_over_direct": statistics.median(rebuilt) / statistics.median(direct)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    out = {}
    with Runtime(devices=(a.device,)) as rt:
        rt.blocking.run(FaultRequest("none"))
        out["tiny_one_at_a_time_us"] = one_at_a_time_us(rt, 2000)
        out["tiny_pipelined_64_us"] = pipelined_us(rt, lambda: rt.submit_run(FaultRequest("none")), 64, 200)
    out["raw_pipe_one_at_a_time_us"], out["raw_pipe_pipelined_64_us"] = raw_pipe_us(2000)
    print(f"bare pipe to an echo process: {out['raw_pipe_one_at_a_time_us']:.1f} us, pipelined "
          f"{out['raw_pipe_pipelined_64_us']:.1f} us", flush=True)
    print(f"tiny request round trip on {a.device}: one at a time {out['tiny_one_at_a_time_us']:.1f} us, "
          f"pipelined 64 deep {out['tiny_pipelined_64_us']:.1f} us per request", flush=True)
    if dev.type == "cuda":
        out["sparse24"] = s = sparse24_through_runtime(a.device, a.rounds)
        print(f"2:4 linear n=16 8192x8192 bf16 ({s['backend']}): direct {s['direct_calls_per_s']:.0f}/s, through "
              f"the runtime {s['runtime_calls_per_s']:.0f}/s ({s['runtime_over_direct']:.2f}x), prepared "
              f"{s['prepared_calls_per_s']:.0f}/s ({s['prepared_over_direct']:.2f}x), a new request object each call "
              f"{s['rebuilt_calls_per_s']:.0f}/s ({s['rebuilt_over_direct']:.2f}x)", flush=True)
    env = environment(dev)
    env["cpu_count"] = os.cpu_count()
    path = a.out or os.path.join(os.path.dirname(__file__), "results",
                                 f"runtime-{'gpu' if dev.type == 'cuda' else 'cpu'}.json")
    with open(path, "w") as f:
        json.dump({**env, **out}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
