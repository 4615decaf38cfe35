"""The 2:4 kernels of the one layout against dense ``F.linear`` on the sweep set (kernelplan.bench.shapes).

Each weight is held as ``Sparse24Linear`` holds it, in the device layout alone.
For every (M, K) of the public model configs and every batch size: each
kernel that reads the ``sp tiled`` layout, checked against fp64 first, then
timed as a CUDA graph replay (kernel time; ``triton.testing.do_bench_cudagraph``,
median) beside dense ``F.linear`` in the same process, alternating; and the
default path a user calls (``kp.sparse24.linear``, the rule's kernel) eagerly,
host work included, beside ``F.linear``.  Writes
``bench/results/sparse24-sweep-<gpu>.json`` and prints a summary.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.kernels.sparse24_mma import MmaLinear
from kernelplan.kernels.sparse24_sp import SpKernel
from kernelplan.kernels.sparse24_ws import WsKernel, ws_config
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.sparse24 import compress, linear, prune
from kernelplan.sparse24.dispatch import backend_for
from kernelplan.sparse24.layout import pack_reason
from kernelplan.timing import host_us_per_call

KERNELS = {"cuda_sp": (SpKernel, 64), "cuda_ws": (WsKernel, 1 << 30)}  # cuda_wg: superseded (docs/design/0005)


def eager_ms(fn, calls: int = 20) -> float:
    """Wall ms per call of ``calls`` back-to-back eager calls, host work included (the device drained around them)."""
    return host_us_per_call(fn, torch.device("cuda"), calls) / 1e3


def precompile(shapes, batch, sms: int, dtype: str) -> None:
    """Every cuda_ws variant the sweep will run, compiled in threads (NVRTC is thread-safe), before any timing."""
    import concurrent.futures

    from kernelplan.kernels.sparse24_ws import _launcher

    configs = {ws_config(n, m, k, sms) for (m, k) in shapes for n in batch if n > 16}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda c: _launcher(c, dtype, False, None, 0), configs))


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def graph_ms(fn, rep: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def run(quick: bool, dtype: torch.dtype, rep: int) -> dict:
    shapes = sweep_shapes()
    batch = (1, 16, 64, 256, 1024, 4096) if quick else BATCH_SIZES
    sms = sm_count(0)
    precompile(shapes, batch, sms, "bf16" if dtype == torch.bfloat16 else "f16")
    rows = []
    for (m, k), where in shapes.items():
        w = prune(torch.randn(m, k, device="cuda")).to(dtype)
        w24 = compress(w)
        if pack_reason(m, k) is None:  # held as Sparse24Linear holds it: the device layout alone
            w24 = w24.packed()
        dense_bytes = w.numel() * w.element_size()
        for n in batch:
            x = torch.randn(n, k, device="cuda").to(dtype)
            row_dtype = "bf16" if dtype == torch.bfloat16 else "f16"
            ref = F.linear(x.double(), w.double())
            dense = lambda: F.linear(x, w)  # noqa: E731
            dense_err = rel_err(dense(), ref)
            row = {"m": m, "k": k, "n": n, "layers": where, "dense_err": dense_err}
            times = {}
            for name, (kernel, max_n) in KERNELS.items():
                if n > max_n:
                    continue
                call = MmaLinear(None, kernel())
                err = rel_err(call(x, w24.values, w24.metadata, None), ref)
                row[f"{name}_err"] = err
                if not err <= 2 * dense_err + 1e-3:
                    row[f"{name}_wrong"] = True
                    continue
                fn = lambda call=call: call(x, w24.values, w24.metadata, None)  # noqa: E731
                # Alternating, so that a slow spell of the GPU lands on both.
                t_d1, t_k1 = graph_ms(dense, rep), graph_ms(fn, rep)
                t_d2, t_k2 = graph_ms(dense, rep), graph_ms(fn, rep)
                times[name] = min(t_k1, t_k2)
                row[f"{name}_ms"] = times[name]
                row.setdefault("dense_ms_all", []).extend([t_d1, t_d2])
            row["dense_ms"] = statistics.median(row.pop("dense_ms_all", [float("nan")]))
            # The default path, as a user calls it: kp.sparse24.linear (memory="compact", the rule's kernel),
            # eagerly, host work included, beside F.linear, alternating.
            row["rule"] = rule = backend_for(torch.cuda.get_device_capability(), n, k, row_dtype)
            user = lambda: linear(x, w24)  # noqa: E731
            user()
            eager = {"dense": [], "rule": []}
            for _ in range(3):
                eager["dense"].append(eager_ms(dense))
                eager["rule"].append(eager_ms(user))
            row["dense_eager_ms"] = statistics.median(eager["dense"])
            row["rule_eager_ms"] = statistics.median(eager["rule"])
            row["eager_speedup"] = row["dense_eager_ms"] / row["rule_eager_ms"]
            if n > 16:
                row["ws_config"] = str(ws_config(n, m, k, sms))
            for name, t in times.items():
                row[f"{name}_speedup"] = row["dense_ms"] / t
            if times:
                best = min(times, key=times.get)
                row["best_one_layout"] = best
            if rule in times:
                row["speedup"] = row["dense_ms"] / times[rule]  # the rule's kernel, as a CUDA graph
            rows.append(row)
            print(f"{m:>6}x{k:<6} n={n:<5} dense {row['dense_ms'] * 1e3:8.1f} us  " + "  ".join(
                f"{nm} {row.get(nm + '_speedup', float('nan')):.2f}x" for nm in KERNELS if nm in times)
                + ("  WRONG " + ",".join(nm for nm in KERNELS if row.get(nm + "_wrong")) if any(
                    row.get(nm + "_wrong") for nm in KERNELS) else ""), flush=True)
        # Bytes held after the calls at every n: the weight as held, and anything its calls derived from it.
        held = w24.values.nbytes + w24.metadata.nbytes + sum(w24.derived_bytes().values())
        rows.append({"m": m, "k": k, "memory": {"dense_bytes": dense_bytes, "layout": w24.layout,
                                                "held_bytes": held, "ratio": held / dense_bytes}})
        del w, w24
        torch.cuda.empty_cache()
    return {"rows": rows, "batch_sizes": list(batch)}


def resources(rows: list[dict], dtype: str) -> list[str]:
    """Registers and local memory (spills) of each cuda_ws variant the sweep ran: the compiler's report."""
    from cuda.bindings import driver as cu

    from kernelplan.kernels import nvrtc
    from kernelplan.kernels.sparse24_ws import WsConfig, source

    lines = []
    for text in sorted({r["ws_config"] for r in rows if "ws_config" in r}):
        cfg = eval(text, {"WsConfig": WsConfig})  # our own repr
        fn = nvrtc.function(source(cfg, dtype, False, None), "kp_sparse24_ws", 0, "sm_90a")
        regs = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)[1]
        local = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)[1]
        lines.append(f"{text}: {regs} registers, {local} bytes local")
    return lines


def summary(rows: list[dict]) -> list[str]:
    lines = []
    timed = [r for r in rows if "speedup" in r]
    for label, lo, hi in (("n <= 16", 1, 16), ("n = 32-64", 32, 64), ("n = 128-512", 128, 512),
                          ("n >= 1024", 1024, 1 << 30)):
        s = sorted(r["speedup"] for r in timed if lo <= r["n"] <= hi)
        if s:
            lines.append(f"{label:12} min {s[0]:.2f}x  median {statistics.median(s):.2f}x  max {s[-1]:.2f}x  "
                         f"({len(s)} rows)")
    worst = sorted(timed, key=lambda r: r["speedup"])[:8]
    lines.append("worst rows (graph): " + "; ".join(f"{r['m']}x{r['k']} n={r['n']} {r['speedup']:.2f}x "
                                                    f"({r['rule']})" for r in worst))
    eager = [r for r in rows if "eager_speedup" in r]
    for label, lo, hi in (("n <= 16", 1, 16), ("n = 32-64", 32, 64), ("n = 128-512", 128, 512),
                          ("n >= 1024", 1024, 1 << 30)):
        s = sorted(r["eager_speedup"] for r in eager if lo <= r["n"] <= hi)
        if s:
            lines.append(f"eager {label:12} min {s[0]:.2f}x  median {statistics.median(s):.2f}x  max {s[-1]:.2f}x")
    small = [r for r in eager if r["dense_eager_ms"] < 0.05]  # host-bound calls: the host work compared
    if small:
        lines.append(f"host-bound calls (dense < 50 us eager): kp.sparse24.linear / F.linear wall per call, median "
                     f"{statistics.median(r['rule_eager_ms'] / r['dense_eager_ms'] for r in small):.2f}x "
                     f"({len(small)} rows)")
    wrong = [r for r in rows if any(k.endswith("_wrong") for k in r)]
    lines.append(f"rows with a wrong kernel result: {len(wrong)}")
    ratios = [r["memory"]["ratio"] for r in rows if "memory" in r]
    lines.append(f"bytes held per weight (one layout): {min(ratios):.4f}-{max(ratios):.4f}x of dense")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="6 batch sizes instead of 12")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--rep", type=int, default=20, help="ms per timing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    t0 = time.time()
    result = run(args.quick, dtype, args.rep)
    gpu = torch.cuda.get_device_name().split()[1].lower() if len(torch.cuda.get_device_name().split()) > 1 else "gpu"
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("KERNELPLAN_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dtype": args.dtype, "timing": "CUDA graph replay, median (triton.testing.do_bench_cudagraph)",
           **result}
    name = f"sparse24-sweep-{gpu}" + ("" if args.dtype == "bf16" else f"-{args.dtype}")
    path = args.out or os.path.join(os.path.dirname(__file__), "results", f"{name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("\n".join(resources(result["rows"], args.dtype)))
    print("\n".join(summary(result["rows"])))
    print(f"wrote {path} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
