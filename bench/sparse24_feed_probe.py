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
replays, weights rotated past L2, alternating with dense ``F.linear`` (``sparse24_wg_tiles.graph_ms``).  The SM clock
and the board's power are read through NVML while each round replays (the carried ``nvidia-ml-py``; without it they
are left out), so that a step's time can be put in cycles: a 2:4 kernel may run at a lower clock than dense
(docs/design/0014).  Not ``sparse24_clocks.py``'s nvidia-smi sampling: that needs seconds of replay a reading,
where these rounds are about 2 ms.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_feed_probe.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.errors import KernelPlanError
from kernelplan.kernels import raw_stream, sparse24_ws, sparse24_ws_rule
from kernelplan.kernels.gpu_facts import device_facts
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import SM_SHARED, _tiled
from kernelplan.sparse24 import compress, prune
from sparse24_wg_tiles import L2_BYTES, graph_ms

SHAPES = [(4096, 4096), (4608, 3584), (3584, 18944), (28672, 4096), (8192, 8192), (2304, 768), (3072, 3072)]
BATCH = (128, 256, 512, 1024, 4096)
MODES = {"full": {}, "feed": {"KP_PROBE": 1}, "mma": {"KP_PROBE": 2}}


def launchers(cfg, n: int, m: int, modes: dict) -> dict:
    """``{mode: (launch, grid)}`` of the builds of ``cfg``, each compiled with its mode's ``#define``s."""
    kernel, plain = sparse24_ws.WsKernel(), sparse24_ws.source
    out = {}
    try:
        for mode, defs in modes.items():
            head = "".join(f"#define {k} {v}\n" for k, v in defs.items())
            sparse24_ws.source = lambda *a, head=head, **k: head + plain(*a, **k)
            sparse24_ws._launcher.cache_clear()
            try:
                out[mode] = kernel.launch_config(cfg, n, m, "bf16", False, None, 0)
                out[mode][0].pdl = defs.get("KP_PDL", "0") != "0"  # the build that lets the next call start early
            except KernelPlanError as e:  # a switch's static_assert: the build is not for this tile (KP_PUSH_SUMS)
                if mode == "full":
                    raise
                why = next((ln for ln in str(e).splitlines() if "error" in ln), str(e))
                print(f"  {cfg}: no {mode} build ({why.strip()[:100]})", flush=True)
    finally:
        sparse24_ws.source = plain
        sparse24_ws._launcher.cache_clear()
    return out


class Sensor:
    """The SM clock (MHz) and board power (W) through NVML, one reading a call; nothing where NVML is missing."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._dev = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as e:  # the bench's timings stand without it
            print(f"no SM clock or power readings: {e}", flush=True)
            self._nvml = None
        self.readings: list[tuple[float, float]] = []

    def __call__(self) -> None:
        if self._nvml is not None:
            nv = self._nvml
            self.readings.append((nv.nvmlDeviceGetClockInfo(self._dev, nv.NVML_CLOCK_SM),
                                  nv.nvmlDeviceGetPowerUsage(self._dev) / 1e3))

    def drain(self) -> list[tuple[float, float]]:
        """The (clock, power) readings since the last drain."""
        got, self.readings = self.readings, []
        return got


def intake(cfg, n: int, m: int, k: int, sms: int) -> tuple[int, int, int]:
    """(bytes into the SMs' shared memory over the call, SMs the grid occupies at once, 64-column steps of one tile
    of BN x 64 wm in all)."""
    step = cfg.bn * 128 + cfg.wm * 4 * 1152  # x's box whole (multicast or not), then W's values and metadata
    tiles = -(-n // cfg.bn) * -(-m // cfg.rows)
    if cfg.pp or cfg.sk:  # one CTA an SM, over every tile
        return tiles * (k // 64) * step, min(sms, tiles), tiles * (k // 64)
    tiles_n, blocks, slices = cfg.grid(n, m)
    ctas, steps = tiles_n * blocks * slices, tiles_n * blocks * (k // 64)  # a tile's K slices run its steps once
    return steps * step, min(sms, ctas), steps


def check(fns: dict, y: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Each full build's y (its first copy of W) against dense, to 2^-5 of y's largest: a wrong sum is of its
    order."""
    for name in (nm for nm in fns if nm.startswith("full")):
        y.fill_(float("nan"))
        fns[name][0]()
        err = float((y.float() - want).abs().max()) / float(want.abs().max())
        if not err <= 2.0 ** -5:
            raise SystemExit(f"{what} {name}: relative error {err:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--batch", type=int, nargs="*", default=BATCH)
    ap.add_argument("--top", type=int, default=2, help="the TOP tiles of least rule cost (the rule's pick first)")
    ap.add_argument("--stages", type=int, nargs="*", default=(),
                    help="also each tile with rings of these many stages where they fit, full and feed alone "
                         "(full_sS, feed_sS): whether the bytes in flight bound the feed")
    ap.add_argument("--full-only", action="store_true", help="the kernel as it ships alone (and its --stages rings)")
    ap.add_argument("--define", nargs="*", default=(), metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also the full kernel built with each of these #defines, comma-joined ones in one build "
                         "(mode full_NAME=VALUE)")
    a = ap.parse_args()
    modes = {"full": MODES["full"]} if a.full_only else dict(MODES)
    for d in a.define:  # NAME=VALUE[,NAME=VALUE...]: one build with all of them
        modes[f"full_{d}"] = dict(kv.split("=") for kv in d.split(","))
    sms = sm_count(0)
    sensor = Sensor()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else SHAPES
    rows = []
    print("us a call; cycles a step of one tile on an occupied SM at the clock read while it ran (MMA: at the sparse "
          "rate, 4096 multiply-adds a cycle); intake: bytes a cycle an SM", flush=True)
    print(f"{'M':>6} {'K':>6} {'n':>5} {'tile':<44} {'dense':>7} {'full':>7} {'feed':>7} {'mma':>7} {'x':>5}  "
          f"{'cycles full/feed/mma/MMA':>24} {'intake':>6} {'MHz dense/full':>14}", flush=True)
    for m, k in shapes:
        copies = max(1, min(8, -(-L2_BYTES // (m * k))))
        ws = [prune(torch.randn(m, k, device="cuda")).bfloat16() for _ in range(copies)]
        tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
        for n in a.batch:
            x = torch.randn(n, k, device="cuda").bfloat16()
            y = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0]).float()
            cost = lambda c: sparse24_ws_rule.tile_cost(c, n, m, k, sms)
            rule = sparse24_ws_rule.ws_config(n, m, k, sms, gpu=device_facts(0))  # the device's own rule
            tiles = list(dict.fromkeys([rule] + sorted(sparse24_ws_rule.ws_candidates(n, m, k), key=cost)))[: a.top]
            calls = max(20, min(400, int(2e-3 * 7e14 / (2 * m * k * n))))  # rounds of about 2 ms: NVML reads
            for cfg in tiles:
                fns = {"dense": [lambda w=w: F.linear(x, w) for w in ws]}
                builds = [(mode, launch, grid) for mode, (launch, grid) in launchers(cfg, n, m, modes).items()]
                for depth in (s for s in a.stages if s != cfg.stages):
                    ring = dataclasses.replace(cfg, stages=depth)
                    if ring.shared > SM_SHARED:
                        continue
                    both = {nm: modes[nm] for nm in ("full", "feed") if nm in modes}
                    builds += [(f"{mode}_s{depth}", launch, grid)
                               for mode, (launch, grid) in launchers(ring, n, m, both).items()]
                for mode, launch, grid in builds:
                    fns[mode] = [lambda p=p, c=c, launch=launch, grid=grid: launch(
                        grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(), n, m, k, x.stride(0),
                               y.stride(0)), raw_stream(0)) for p, c in tiled]
                check(fns, y, want, f"{m}x{k} n={n} {cfg}")
                times, reads = {name: [] for name in fns}, {name: [] for name in fns}
                for r in range(2):
                    for name in list(fns) if r == 0 else list(fns)[::-1]:
                        times[name] += graph_ms(fns[name], calls, a.rounds, during=sensor)
                        reads[name] += sensor.drain()
                check(fns, y, want, f"{m}x{k} n={n} {cfg} (after its timing)")
                med = {name: statistics.median(t) for name, t in times.items()}
                mhz = {name: statistics.median(r[0] for r in rs) if rs else None for name, rs in reads.items()}
                watts = {name: statistics.median(r[1] for r in rs) if rs else None for name, rs in reads.items()}
                into, active, steps = intake(cfg, n, m, k, sms)
                # One step's time on an occupied SM, in cycles of the clock read while it ran.
                cycles = {nm: med[nm] * 1e3 * mhz[nm] * active / steps if mhz[nm] else None for nm in modes
                          if nm in med}
                mma = cfg.rows * cfg.bn * 64 / 4096
                fed = med.get("feed")
                row = {"m": m, "k": k, "n": n, "tile": str(cfg), "rule": cfg == rule, "ms": med, "sm_mhz": mhz,
                       "power_w": watts, "bytes_into_sms": into, "sms_occupied": active, "tile_steps": steps,
                       "cycles_a_step": cycles, "mma_cycles_a_step": mma,
                       "feed_bytes_per_ns_per_sm": into / (fed * 1e6) / active if fed else None}
                rows.append(row)
                us = {nm: v * 1e3 for nm, v in med.items()}
                rings = "".join(f"  s{nm.split('_s')[1]} {nm.split('_')[0]} {med[nm] / med[nm.split('_')[0]]:.3f}x"
                                for nm in med if "_s" in nm and "=" not in nm)
                rings += "".join(f"  {nm[5:]} {med[nm] / med['full']:.3f}x" for nm in med if "=" in nm)
                line = f"{m:6d} {k:6d} {n:5d} {str(cfg)[9:-1]:<44} {us['dense']:7.1f} {us['full']:7.1f} "
                if fed:
                    cyc = "/".join(f"{cycles[nm]:.0f}" if cycles[nm] else "-" for nm in MODES) + f"/{mma:.0f}"
                    per_cycle = into / (fed * 1e3 * mhz["feed"]) / active if mhz["feed"] else float("nan")
                    line += (f"{us['feed']:7.1f} {us['mma']:7.1f} {med['dense'] / med['full']:5.2f}  {cyc:>24} "
                             f"{per_cycle:6.1f} ")
                else:
                    line += f"{med['dense'] / med['full']:5.2f} "
                print(line + f"{mhz['dense'] or 0:>5.0f}/{mhz['full'] or 0:.0f}{rings}", flush=True)
        del ws, tiled
        torch.cuda.empty_cache()
        results.write("sparse24-feed-probe", {"rows": rows}, a.out, dtype="bf16", sms=sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
