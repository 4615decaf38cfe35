"""What bounds a ``wgmma.sp`` tile's K loop: the same tile with its copies alone and with its MMAs alone.

Why: at n = 128-512 a 64-column step takes about 360 cycles where the MMAs allow about 200 (docs/design/0016),
and neither a second warpgroup on the tile (0035) nor more CTAs (0027) made it faster.  0035 read that as the
bytes a step brings into the SM.  This bench times three builds of one tile (``KP_PROBE`` in
``kernels/cuda/sparse24_ring.cuh``):

* ``full``: the kernel as it ships;
* ``feed``: the producer's copies, every consumer waiting for each stage and releasing it, no MMA;
* ``mma``: the consumers' MMAs and barriers, the producer copying nothing (the MMAs read stale shared memory).

If ``full`` sits on ``feed``, the copies bound the tile.  Each SM's intake is then the tile's bytes (x's box, whole
even where it is multicast, and W's values and metadata) over the time and the SMs the grid occupies.  CUDA graph
replays, weights rotated past L2, alternating with dense ``F.linear`` (``sparse24_wg_tiles.graph_ms``).

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_feed_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.kernels import raw_stream, sparse24_ws
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.sparse24 import compress, prune
from sparse24_wg_tiles import L2_BYTES, graph_ms

SHAPES = [(4096, 4096), (4608, 3584), (3584, 18944), (28672, 4096), (8192, 8192), (2304, 768), (3072, 3072)]
BATCH = (128, 256, 512, 1024, 4096)
MODES = {"full": 0, "feed": 1, "mma": 2}


def launchers(cfg, n: int, m: int) -> dict:
    """``{mode: (launch, grid)}`` of the three builds of ``cfg``: each compiled with its ``KP_PROBE``."""
    kernel, plain = sparse24_ws.WsKernel(), sparse24_ws.source
    out = {}
    try:
        for mode, probe in MODES.items():
            sparse24_ws.source = lambda *a, probe=probe, **k: f"#define KP_PROBE {probe}\n" + plain(*a, **k)
            sparse24_ws._launcher.cache_clear()
            out[mode] = kernel.launch_config(cfg, n, m, "bf16", False, None, 0)
    finally:
        sparse24_ws.source = plain
        sparse24_ws._launcher.cache_clear()
    return out


def intake(cfg, n: int, m: int, k: int, sms: int) -> tuple[int, int]:
    """(bytes into the SMs' shared memory over the call, SMs the grid occupies at once)."""
    step = cfg.bn * 128 + cfg.wm * 4 * 1152  # x's box whole (multicast or not), then W's values and metadata
    tiles = -(-n // cfg.bn) * -(-m // cfg.rows)
    if cfg.pp or cfg.sk:  # one CTA an SM, over every tile
        return tiles * (k // 64) * step, min(sms, tiles)
    ctas = -(-n // cfg.bn) * -(-(-(-m // cfg.rows)) // cfg.cm) * cfg.cm * cfg.kc
    return ctas * (k // 64 // cfg.kc) * step, min(sms, ctas)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--batch", type=int, nargs="*", default=BATCH)
    ap.add_argument("--top", type=int, default=2, help="the TOP tiles of least rule cost (the rule's pick first)")
    a = ap.parse_args()
    sms = sm_count(0)
    clock = torch.cuda.get_device_properties(0).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else SHAPES
    rows = []
    print(f"{'M':>6} {'K':>6} {'n':>5} {'tile':<44} {'dense':>7} {'full':>7} {'feed':>7} {'mma':>7}  "
          f"{'x':>5} {'full/feed':>9} {'B/ns/SM feed':>12}", flush=True)
    for m, k in shapes:
        copies = max(1, min(8, -(-L2_BYTES // (m * k))))
        ws = [prune(torch.randn(m, k, device="cuda")).bfloat16() for _ in range(copies)]
        tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
        for n in a.batch:
            x = torch.randn(n, k, device="cuda").bfloat16()
            y = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            cost = lambda c: sparse24_ws.tile_cost(c, n, m, k, sms)
            rule = sparse24_ws.ws_config(n, m, k, sms)
            tiles = list(dict.fromkeys([rule] + sorted(sparse24_ws.ws_candidates(n, m, k), key=cost)))[: a.top]
            calls = max(6, min(100, int(2e-3 * 2e12 / (2 * m * k * n + 1))))
            for cfg in tiles:
                fns = {"dense": [lambda w=w: F.linear(x, w) for w in ws]}
                for mode, (launch, grid) in launchers(cfg, n, m).items():
                    fns[mode] = [lambda p=p, c=c, launch=launch, grid=grid: launch(
                        grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(), n, m, k, x.stride(0),
                               y.stride(0)), raw_stream(0)) for p, c in tiled]
                y.fill_(float("nan"))
                fns["full"][0]()
                err = float((y.float() - want).abs().max()) / float(want.abs().max())
                if not err <= 2.0 ** -5:
                    raise SystemExit(f"{m}x{k} n={n} {cfg}: relative error {err:.3g}")
                times = {name: [] for name in fns}
                for r in range(2):
                    for name in list(fns) if r == 0 else list(fns)[::-1]:
                        times[name] += graph_ms(fns[name], calls, a.rounds)
                med = {name: statistics.median(t) for name, t in times.items()}
                into, active = intake(cfg, n, m, k, sms)
                per_sm = into / (med["feed"] * 1e6) / active  # bytes a ns an occupied SM
                row = {"m": m, "k": k, "n": n, "tile": str(cfg), "rule": cfg == rule, "ms": med,
                       "bytes_into_sms": into, "sms_occupied": active, "feed_bytes_per_ns_per_sm": per_sm,
                       "full_bytes_per_ns_per_sm": into / (med["full"] * 1e6) / active}
                rows.append(row)
                us = {nm: v * 1e3 for nm, v in med.items()}
                print(f"{m:6d} {k:6d} {n:5d} {str(cfg)[9:-1]:<44} {us['dense']:7.1f} {us['full']:7.1f} "
                      f"{us['feed']:7.1f} {us['mma']:7.1f}  {med['dense'] / med['full']:5.2f} "
                      f"{med['full'] / med['feed']:9.2f} {per_sm:12.1f}", flush=True)
        del ws, tiled
        torch.cuda.empty_cache()
        results.write("sparse24-feed-probe", {"rows": rows}, a.out, dtype="bf16", sms=sms, sm_clock_hz=clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
