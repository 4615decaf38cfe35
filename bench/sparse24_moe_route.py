"""The MoE routing kernel (``kernels/moe_route.py``) against the torch ops' routing, in one experts call, on the GPU.

``Sparse24Experts``' grouped forward routes its (token, k) pairs by the kernel, where it had six torch ops.  Here the
same module, in one process, runs each way on the same inputs, the ways alternating round by round: the torch ops
(``torch_route``, what the grouped forward ran before the kernel), and the kernel with each chunk size of
``--chunks`` (``_B``, with ``_CB`` chunks' counts a summing step: 1024 // B), each with the counts summed in every
``_route`` program and by their own launch (``scan``, ``_SCAN_MIN_CHUNKS`` at 1).  For each published config and
token count:

* the call replayed as a CUDA graph (``triton.testing.do_bench_cudagraph``), median over ``--graph-rounds``;
* the host work of an eager call alone (the clock stops when the last of 20 calls returns), over ``--rounds``;
* that every way's output equals the torch ops' bit for bit (a row's place is the stable sort's either way).

Writes ``bench/results/sparse24-moe-route-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_moe_route.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from kernelplan.bench import results
from kernelplan.kernels import moe_route
from kernelplan.timing import host_us_per_call

from sparse24_experts import MODELS, sparse_calls


def torch_route(ids, weights, x, experts, y=None):
    """``moe_route.route`` by torch ops: a stable sort of the ids (those outside the experts last), ``searchsorted``
    for the offsets, ``index_select`` for the rows of x, the weights as float32, and y zeroed."""
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(torch.where((flat >= 0) & (flat < experts), flat, experts), stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(experts + 1, device=ids.device, dtype=ids.dtype),
                                 out_int32=True)
    if y is not None:
        y.zero_()
    return x.index_select(0, torch.div(order, ids.shape[1], rounding_mode="floor")), order, offsets, \
        weights.reshape(-1).float()


KERNEL_ROUTE = moe_route.route


def _set(way: tuple[int, bool] | None) -> None:
    """Route by the torch ops (None), or by the kernel with chunks of ``way[0]`` pairs, the counts summed by their
    own launch where ``way[1]``."""
    if way is None:
        moe_route.route = torch_route
    else:
        moe_route.route = KERNEL_ROUTE
        moe_route._B, moe_route._CB = way[0], max(1, 1024 // way[0])
        moe_route._SCAN_MIN_CHUNKS = 1 if way[1] else 1 << 30


def main() -> int:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["OLMoE-1B-7B", "Qwen3-30B-A3B", "Mixtral-8x7B"],
                    choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="*", default=(32, 128, 512, 2048))
    ap.add_argument("--chunks", type=int, nargs="*", default=(32,))
    ap.add_argument("--rounds", type=int, default=3, help="host-time rounds")
    ap.add_argument("--graph-rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    ways = {"torch": None, **{f"b{c}{' scan' * scan}": (c, scan) for c in a.chunks for scan in (False, True)}}
    saved = moe_route.route, moe_route._B, moe_route._CB, moe_route._SCAN_MIN_CHUNKS
    rows = []
    cuda = torch.device("cuda")
    for model, (count, hidden, _, k), tokens, call in sparse_calls(a.models, a.tokens):
        graph, host, equal = {w: [] for w in ways}, {w: [] for w in ways}, {}
        with torch.no_grad():
            _set(None)
            want = call()
            for r in range(max(a.rounds, a.graph_rounds)):
                for way, chunk in (list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]):
                    _set(chunk)
                    equal[way] = equal.get(way, True) and torch.equal(call(), want)
                    for _ in range(3):
                        call()
                    if r < a.rounds:
                        host[way].append(host_us_per_call(call, cuda, 20, wait=False))
                    if r < a.graph_rounds:
                        graph[way].append(triton.testing.do_bench_cudagraph(call, rep=40) * 1e3)
        row = {"model": model, "experts": count, "hidden": hidden, "top_k": k, "tokens": tokens,
               "pairs": tokens * k, "graph_us": {w: statistics.median(v) for w, v in graph.items()},
               "host_us": {w: statistics.median(v) for w, v in host.items()}, "bitwise_equal": equal}
        row["graph_over_torch"] = {w: row["graph_us"][w] / row["graph_us"]["torch"] for w in ways}
        rows.append(row)
        print(f"{model:15s} T={tokens:5d} pairs={tokens * k:6d}  graph us " +
              "  ".join(f"{w} {v:7.1f}" for w, v in row["graph_us"].items()) + "  host us " +
              "  ".join(f"{w} {v:5.0f}" for w, v in row["host_us"].items()) +
              ("" if all(equal.values()) else f"  NOT EQUAL {equal}"))
    moe_route.route, moe_route._B, moe_route._CB, moe_route._SCAN_MIN_CHUNKS = saved
    results.write("sparse24-moe-route", {"rows": rows}, a.out, dtype="bf16",
                  timing="one process; ways alternating by round; graph: do_bench_cudagraph median; host: 20 eager "
                         "calls, the clock stopped when the last returned")
    return 0 if all(all(r["bitwise_equal"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
