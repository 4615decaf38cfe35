"""Where the ping-pong kernel's stream-K schedule loses time (docs/design/0027): for a few problems, CUDA graph
replays of the ping-pong tile, its stream-K schedule as launched (a workspace and a flag memset a call), and the
stream-K kernel alone on one workspace whose flags the heads leave zero (no memset, no allocation).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_streamk_probe.py
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from kernelplan.bench import results
from kernelplan.kernels import raw_stream
from kernelplan.kernels.direct import FunctionLaunch
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels.sparse24_ws import WsKernel, _deepest, streamk_plan
from kernelplan.sparse24 import compress, prune
from sparse24_wg_tiles import graph_ms

PROBLEMS = [(128, 4608, 3584, 128, 1), (256, 4608, 3584, 128, 2), (128, 28672, 4096, 128, 2),
            (256, 8192, 8192, 128, 2), (512, 8192, 8192, 128, 2), (128, 8192, 8192, 64, 2)]


def main() -> int:
    sms, rows = sm_count(0), []
    for n, m, k, bn, wm in PROBLEMS:
        w = prune(torch.randn(m, k, device="cuda")).bfloat16()
        pairs, codes = _tiled(*(lambda c: (c.values, c.metadata))(compress(w)))
        x = torch.randn(n, k, device="cuda").bfloat16()
        y = torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
        args = (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), 0, y.data_ptr(), n, m, k, k, m)
        want = F.linear(x, w).float()
        fns = {"dense": lambda: F.linear(x, w)}
        for name, cfg in (("pp", _deepest(bn, wm, 1, 1, pp=True)), ("streamk", _deepest(bn, wm, 1, 1, pp=True,
                                                                                         streamk=True))):
            launch, grid = WsKernel().launch_config(cfg, n, m, "bf16", False, None, 0)
            fns[name] = lambda launch=launch, grid=grid: launch(grid, args, raw_stream(0))
        plan = streamk_plan(cfg, n, m, k, sms)
        work = torch.zeros(max(plan.workspace_bytes, 4) // 4, dtype=torch.int32, device="cuda")
        params = launch._mapped(args) + (plan.tiles_n, work.data_ptr())
        fns["streamk kernel alone"] = lambda: FunctionLaunch.__call__(launch, (plan.grid, 1, 1), params,
                                                                      raw_stream(0), packed=True)
        errs = {}
        for name, fn in fns.items():
            y.fill_(float("nan"))
            out = fn()
            got = (out if name == "dense" else y).float()
            errs[name] = float((got - want).abs().max() / want.abs().max())
        times = {name: [] for name in fns}
        for r in range(3):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                times[name] += graph_ms([fns[name]], 20, 5)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {"n": n, "m": m, "k": k, "bn": bn, "wm": wm, "grid": plan.grid, "us": med, "rel_err": errs}
        rows.append(row)
        print(f"{m}x{k} n={n} {bn}x{64 * wm}: " + "  ".join(f"{nm} {t:.1f} us" for nm, t in med.items())
              + f"  errs {max(errs.values()):.1e}", flush=True)
        results.write("sparse24-streamk-probe", {"rows": rows}, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
