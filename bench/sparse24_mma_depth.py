"""How many steps of MMAs a consumer warpgroup of the ``wgmma.sp`` kernels leaves in flight (``sparse24_ring.cuh``'s
MMA_DEPTH): 1, the kernels' default, against 2.

With 1, a warpgroup issues step g's MMAs and then waits for step g - 1's, so the next step must be issued within one
step's MMA time: its barrier wait, its metadata word's shared load and its fence.  With 2, it waits for step g - 2's
and releases that stage, so there are two steps' time to issue in.  docs/design/0016 found the K loop waiting at n =
128-512: the tensor pipe was busy a quarter of the time.

For each layer and n: the rule's tile and the next 3 by rule cost, each compiled both ways, checked against dense
and timed as CUDA graph replays.  The replays rotate over weight copies past L2, and the variants alternate
(``sparse24_wg_tiles.graph_ms``).

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_mma_depth.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.kernels import nvrtc, raw_stream, sparse24_ws
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.sparse24 import compress, prune
from sparse24_wg_tiles import L2_BYTES, SHAPES, graph_ms

BATCH = (128, 256, 512, 1024, 4096)


def launcher(cfg, depth: int):
    """The kernel of ``cfg`` compiled with MMA_DEPTH ``depth``: ``sparse24_ws._launcher`` past its cache."""
    plain = sparse24_ws.source
    sparse24_ws.source = lambda *a, **k: f"#define MMA_DEPTH {depth}\n" + plain(*a, **k)
    try:
        return sparse24_ws._launcher.__wrapped__(cfg, "bf16", False, None, 0)
    finally:
        sparse24_ws.source = plain


def grid(cfg, n: int, m: int) -> tuple:
    if cfg.sk or cfg.pp:
        return (0, 0, 0)  # the launch takes it from the problem
    return (-(-n // cfg.bn), -(-(-(-m // cfg.rows)) // cfg.cm) * cfg.cm, cfg.kc)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=BATCH)
    ap.add_argument("--top", type=int, default=4, help="the rule's tile and the next by rule cost")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms, dtype, rows = sm_count(0), torch.bfloat16, []
    picks = {(n, m, k): sorted(sparse24_ws.ws_candidates(n, m, k),
                               key=lambda c: sparse24_ws.rule_order(c, n, m, k, sms))[: a.top]
             for m, k in SHAPES for n in a.batch}
    sources = {f"#define MMA_DEPTH {d}\n" + sparse24_ws.source(c, "bf16", False, None)
               for cands in picks.values() for c in cands for d in (1, 2)}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # NVRTC is thread-safe; the timing loop then only loads
        list(pool.map(lambda src: nvrtc.cubin(src, sparse24_ws.WsKernel.architecture), sources))
    print(f"{len(sources)} variants compiled", flush=True)
    for m, k in SHAPES:
        copies = max(1, min(8, -(-L2_BYTES // (m * k))))
        ws = [prune(torch.randn(m, k, device="cuda")).to(dtype) for _ in range(copies)]
        tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
        for n in a.batch:
            x = torch.randn(n, k, device="cuda").to(dtype)
            y = torch.empty(n, m, device="cuda", dtype=dtype)
            want = F.linear(x, ws[0]).float()
            scale = float(want.abs().max())
            cands = picks[n, m, k]
            fns, errs = {"dense": [lambda w=w: F.linear(x, w) for w in ws]}, {}
            for cfg in cands[: a.top]:
                for depth in (1, 2):
                    launch, g = launcher(cfg, depth), grid(cfg, n, m)
                    fs = [lambda p=p, c=c, launch=launch, g=g: launch(g, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0,
                                                                        y.data_ptr(), n, m, k, x.stride(0),
                                                                        y.stride(0)), raw_stream(0))
                          for p, c in tiled]
                    name = f"{cfg} depth {depth}"
                    y.fill_(float("nan"))
                    fs[0]()
                    errs[name] = float((y.float() - want).abs().max()) / scale
                    if errs[name] <= 2.0 ** -5:
                        fns[name] = fs
            calls = max(6, min(100, int(2e-3 * 2e12 / (2 * m * k * n + 1))))
            times = {name: [] for name in fns}
            for r in range(2):
                for name in list(fns) if r == 0 else list(fns)[::-1]:
                    times[name] += graph_ms(fns[name], calls, a.rounds)
            med = {name: statistics.median(t) for name, t in times.items()}
            wrong = [name for name in errs if name not in fns]
            rows.append({"m": m, "k": k, "n": n, "dense_ms": med.pop("dense"), "tiles_ms": med, "wrong": wrong,
                         "rule": str(cands[0])})
            pairs = [(str(c), med.get(f"{c} depth 1"), med.get(f"{c} depth 2")) for c in cands[: a.top]]
            ratio = [d1 / d2 for _, d1, d2 in pairs if d1 and d2] or [float("nan")]
            x1, x2 = (rows[-1]["dense_ms"] / t if t else float("nan") for t in pairs[0][1:])
            print(f"{m:6d} {k:6d} n={n:5d} rule depth 1 {x1:5.2f}x depth 2 {x2:5.2f}x  depth 2 faster by "
                  f"{min(ratio):.3f}-{max(ratio):.3f} over {len(ratio)} tiles  wrong {len(wrong)}", flush=True)
        del ws, tiled
        torch.cuda.empty_cache()
        results.write("sparse24-mma-depth", {"rows": rows}, a.out, dtype="bf16", sms=sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
