"""Every tile of a ``wgmma.sp`` kernel on a spread of sweep shapes: ``--kernel wg`` (``kernels/sparse24_wg.py``,
``wg_candidates``) or ``--kernel ws`` (the warp-specialized one, ``kernels/sparse24_ws.py``; its tiles are
``sparse24_ws_rule.ws_candidates``).

The data the configuration rule is built from.  For each (M, K) and n: dense
``F.linear`` and every candidate tile, each checked against the dense result
first, then timed as the sweep times (``graph_us``: CUDA graph replays of ~``--rep`` ms of back-to-back calls, no
host work), alternating between tiles, rotating over enough copies of the weight that it
is not served from L2 (medians of rounds).  Writes ``bench/results/sparse24-<kernel>-tiles-<gpu>.json``
and prints, per (M, K, n), the best tile, its speedup over dense, and the
present rule's.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_wg_tiles.py --kernel ws
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.activations import GATED_EPILOGUES, epilogue_columns
from kernelplan.bench import results
from kernelplan.bench.sweep import _cycling
from kernelplan.kernels import raw_stream
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels import sparse24_wg, sparse24_ws, sparse24_ws_rule
from kernelplan.sparse24 import compress, prune
from kernelplan.sparse24.plan import gated_reason
from kernelplan.timing import graph_us

SHAPES = [(4096, 4096), (4608, 3584), (3584, 18944), (28672, 4096), (8192, 8192), (8192, 28672), (3072, 3072),
          (2304, 768), (1024, 4096), (5120, 13824), (37888, 3584)]
BATCH = (32, 64, 128, 256, 512, 1024, 2048, 4096)
L2_BYTES = 100 << 20  # rotate over weight copies past this many bytes (H100 50 MB, H200 60 MB of L2)


def weight_copies(m: int, k: int) -> int:
    """Copies of an M x K weight a round cycles over: past ``L2_BYTES`` (compressed bytes ~ m * k * 1.125), at most
    8 (the sweep's rule differs: ``sweep.copies_past_l2``; docs/design/0055)."""
    return max(1, min(8, -(-L2_BYTES // (m * k))))


def direct_launch(kernel, cfg, x, y, n: int, m: int, k: int, epilogue: str | None = None):
    """``call(values, codes)``: one launch of ``kernel`` on tile ``cfg``, x times the weight held in the device layout
    into ``y`` (allocated once, by the caller), on the current stream: this bench's call, below the library's."""
    launch, grid = kernel.launch_config(cfg, n, m, "bf16", False, epilogue, 0)
    return lambda values, codes: launch(grid, (x.data_ptr(), values.data_ptr(), codes.data_ptr(), 0, y.data_ptr(), n,
                                               m, k, x.stride(0), y.stride(0)), raw_stream(0))


def calls_per_graph(n: int, m: int, k: int) -> int:
    """Calls in one ``graph_ms`` graph as this bench timed tiles until 85d7767 (``sparse24_harness_ab.py``'s
    ``tile-bench``): about 2 ms of work at 2 PFLOP/s, 6 to 100 (6 on the largest problems)."""
    return max(6, min(100, int(2e-3 * 2e12 / (2 * m * k * n + 1))))


def graph_ms(fns, calls: int, rounds: int, during=None) -> list[float]:
    """Per round, mean ms per call of ``calls`` calls cycling over ``fns``, replayed as one CUDA graph (no host work);
    ``during()``, where given, runs on the host each round while the GPU replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        if during is not None:
            during()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return out


def _top(top: int, between: bool, sms: int, n: int, m: int, k: int) -> list:
    """The ``top`` tiles of least rule cost over the rule's space and (``between``) as many over the wider one,
    and as many of 192 rows of W (``wm = 3``)."""
    cost = lambda c: sparse24_ws_rule.tile_cost(c, n, m, k, sms)
    rule = sorted(sparse24_ws_rule.ws_candidates(n, m, k), key=cost)
    space = sorted(sparse24_ws_rule.ws_candidates(n, m, k, between=True), key=cost) if between else rule
    return list(dict.fromkeys(rule[:top] + space[:top] + [c for c in space if c.wm == 3][:top]))


def _wide_split(candidates, n: int, m: int, k: int) -> list:
    """``candidates`` and ``sparse24_ws_rule.wide_k_splits`` of them: tiles of 192 rows of W with K split, which the
    rule's space leaves out (timed at n = 128 on an H100 at 56cd67b, before the pushed sums:
    sparse24-ws-wide-h100.json)."""
    out = candidates(n, m, k)
    return out + sparse24_ws_rule.wide_k_splits(out, k)


def _unicast_pair(waves: float, sms: int, gated: bool, n: int, m: int, k: int) -> list:
    """The rule's least-cost tile (before ``multicast_pays``) and the same tile without x multicast, where the first
    multicasts x without splitting K in a grid of at most ``waves`` waves of CTAs; else nothing (docs/design/0053,
    0054).  ``gated``: among the tiles a gated epilogue runs on."""
    space = [c for c in sparse24_ws_rule.ws_candidates(n, m, k) if not gated or sparse24_ws_rule.gated_tile(c)]
    pick = sparse24_ws_rule.least_cost(space, n, m, k, sms)
    if pick.kc != 1 or pick.cm == 1 or math.prod(pick.grid(n, m)) > waves * sms:
        return []
    return [pick, dataclasses.replace(pick, cm=1)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="readings of each tile, in alternating order")
    ap.add_argument("--rep", type=int, default=20, help="ms of calls a reading replays (graph_us)")
    ap.add_argument("--shapes", type=int, default=len(SHAPES))
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK",
                    help="these (M, K) instead of the built-in list, e.g. 768x768 1024x4096")
    ap.add_argument("--batch", type=int, nargs="*", default=BATCH)
    ap.add_argument("--lm-heads", action="store_true",
                    help="the LM heads of the sweep set's models (bench/shapes.py, lm_head_shapes) instead, held out of "
                         "the rules' fits (docs/design/0052)")
    ap.add_argument("--kernel", choices=("wg", "ws"), default="wg")
    ap.add_argument("--between", action="store_true",
                    help="ws: tiles of x between the halvings of 256 rows too (ws_candidates' between)")
    ap.add_argument("--top", type=int, default=0,
                    help="ws: only the TOP tiles of least rule cost (with --between, over the wider space)")
    ap.add_argument("--unicast-pairs", type=float, default=None, metavar="W",
                    help="ws: only the problems whose rule's pick multicasts x without a K split in a grid of at most "
                         "W waves, and only that pick and the same tile without multicast (docs/design/0053)")
    ap.add_argument("--sweep-set", action="store_true", help="the sweep set's shapes (bench/shapes.py) instead")
    ap.add_argument("--gated", action="store_true",
                    help="ws: the gated epilogue (gated_silu_first: silu of W's first M/2 rows' outputs times the "
                         "rest's) on the tiles it runs on; dense is the plain F.linear")
    ap.add_argument("--wide-split", action="store_true",
                    help="ws: tiles of 192 rows of W with K split over 2 and 4 CTAs too (not in the rule's space)")
    a = ap.parse_args()
    if a.gated and a.kernel != "ws":
        ap.error("--gated runs on --kernel ws only")
    epilogue = "gated_silu_first" if a.gated else None
    dtype = torch.bfloat16
    sms = sm_count(0)
    module = {"wg": sparse24_wg, "ws": sparse24_ws}[a.kernel]
    rules = {"wg": sparse24_wg, "ws": sparse24_ws_rule}[a.kernel]  # cuda_ws's tile rule has its own module
    kernel = module.WgKernel() if a.kernel == "wg" else module.WsKernel()
    candidates, rule_config, _launcher = getattr(rules, f"{a.kernel}_candidates"), \
        getattr(rules, f"{a.kernel}_config"), module._launcher
    if a.gated:
        rule_config = functools.partial(rule_config, gated=True)
    if a.kernel == "ws" and a.unicast_pairs is not None:
        candidates = functools.partial(_unicast_pair, a.unicast_pairs, sms, a.gated)
    elif a.gated:
        candidates = lambda n, m, k: [c for c in sparse24_ws_rule.ws_candidates(n, m, k)
                                      if sparse24_ws_rule.gated_tile(c)]
    elif a.kernel == "ws" and a.top:
        candidates = functools.partial(_top, a.top, a.between, sms)
    elif a.kernel == "ws":  # the persistent split variant too, beside the rule's space
        candidates = functools.partial(candidates, split=True, between=a.between)
    if a.wide_split:
        candidates = functools.partial(_wide_split, candidates)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else SHAPES[: a.shapes]
    if a.lm_heads or a.sweep_set:
        from kernelplan.bench.shapes import lm_head_shapes, sweep_shapes

        shapes = list(lm_head_shapes() if a.lm_heads else sweep_shapes())
    if a.gated:
        shapes = [(m, k) for m, k in shapes if gated_reason(m) is None]
    shapes = [(m, k) for m, k in shapes if any(candidates(n, m, k) for n in a.batch)]
    # Compile every variant first, in threads (NVRTC is thread-safe): the timing loop then only launches.
    configs = {c for (m, k) in shapes for n in a.batch for c in candidates(n, m, k)}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda c: _launcher(c, "bf16", False, epilogue, 0), configs))
    from cuda.bindings import driver as cu

    regs = {}
    for c in configs:
        fn = _launcher(c, "bf16", False, epilogue, 0).function
        attr = cu.CUfunction_attribute
        regs[str(c)] = (cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)[1],
                        cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)[1])
    spills = {c: r for c, r in regs.items() if r[1]}
    print(f"{len(configs)} variants compiled; local memory (spills) in {len(spills)}: {spills}", flush=True)
    rows = []
    for m, k in shapes:
        copies = weight_copies(m, k)
        ws = [prune(torch.randn(m, k, device="cuda")).to(dtype) for _ in range(copies)]
        tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
        for n in a.batch:
            if not candidates(n, m, k):
                continue
            x = torch.randn(n, k, device="cuda").to(dtype)
            y = torch.empty(n, epilogue_columns(m, epilogue), device="cuda", dtype=dtype)
            want = F.linear(x, ws[0]).float()
            want = GATED_EPILOGUES[epilogue].fn(want) if epilogue else want
            scale = float(want.abs().max())
            dense = [lambda w=w: F.linear(x, w) for w in ws]

            def sparse(cfg):
                call = direct_launch(kernel, cfg, x, y, n, m, k, epilogue)
                return [lambda p=p, c=c: call(p, c) for p, c in tiled]

            cands = {str(c): c for c in candidates(n, m, k)}
            fns, errs = {"dense": dense}, {}
            for name, cfg in cands.items():
                fs = sparse(cfg)
                y.fill_(float("nan"))
                fs[0]()
                errs[name] = float((y.float() - want).abs().max()) / scale
                if errs[name] <= 2.0 ** -5:
                    fns[name] = fs
            # The sweep's timer.  The one before (graph_ms: a graph of 6-100 calls, replayed; until 85d7767) read
            # K-split tiles 7% slow against it, and x multicast 2% (docs/design/0056).
            times = {name: [] for name in fns}
            for r in range(a.rounds):  # passes in alternating order, so that a slow spell of the GPU lands on all
                for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                    times[name].append(graph_us(_cycling(fns[name]), a.rep) / 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            rule = str(rule_config(n, m, k, sms))
            best = min((nm for nm in med if nm != "dense"), key=med.get, default=None)
            row = {"m": m, "k": k, "n": n, "dense_ms": med["dense"], "tiles_ms": {nm: med[nm] for nm in med
                                                                                   if nm != "dense"},
                   "wrong": {nm: e for nm, e in errs.items() if nm not in fns}, "rule": rule, "best": best}
            rows.append(row)
            rule_x = med["dense"] / med[rule] if rule in med else float("nan")
            best_x = med["dense"] / med[best] if best else float("nan")
            print(f"{m:6d} {k:6d} n={n:5d} dense {med['dense'] * 1e3:8.1f} us  best {best_x:5.2f}x {best}  "
                  f"rule {rule_x:5.2f}x  wrong {len(row['wrong'])}", flush=True)
        del ws, tiled
        torch.cuda.empty_cache()
        # After each shape, so that a run cut off by a time limit keeps what it measured.
        results.write(f"sparse24-{a.kernel}-tiles", {"rows": rows}, a.out, dtype="bf16", sms=sms, epilogue=epilogue,
                      registers_local_bytes=regs, timer=f"graph_us, rep {a.rep} ms", rounds=a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
