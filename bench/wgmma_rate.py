"""The instruction-rate ceiling of the 2:4 kernels: sparse ``wgmma.sp`` (m64nNk32) beside dense ``wgmma`` (m64nNk16).

``bench/cuda/wgmma_rate.cu`` runs one CTA per SM, each a loop of warpgroup MMAs with
A in registers and B in shared memory (as the 2:4 kernels issue them), and times it
with ``clock64``.  Variants (the kernel's header says what each does): warpgroups,
independent accumulator sets per warpgroup, A re-read from shared memory each step,
a bulk-copy warp writing shared memory meanwhile (a TMA ring's writes), and B read from
a ring of 4 boxes.  Each row gives dense-equivalent multiply-adds per cycle per SM
and the same as TFLOP/s from the launch's wall time.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/wgmma_rate.py
    python bench/wgmma_rate.py --compile-only     # NVRTC only (no GPU): every variant compiles for sm_90a
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "cuda"
STEPS = 2040  # a multiple of every SETS used
SHARED = 227 * 1024  # the most a CTA may have: one CTA per SM

# (sparse, NI, chains, warpgroups, reload, sets, copy, fresh_b): the instruction alone at each N, then the latency
# chains, then what a 2:4 kernel's loop adds to it, then where else its A operand could come from.
VARIANTS = [
    *[(sp, ni, 1, 2, 0, 2, 0, 0) for ni in (64, 128, 256) for sp in (0, 1)],
    *[(sp, ni, 1, 1, 0, 2, 0, 0) for ni in (64, 128, 256) for sp in (0, 1)],
    *[(sp, ni, 2, 2, 0, 2, 0, 0) for ni in (64, 128) for sp in (0, 1)],
    *[(1, ni, 1, 2, 1, 2, 0, 1) for ni in (64, 128, 256)],
    (1, 64, 2, 2, 1, 2, 0, 1),
    *[(sp, 256, 1, 2, 0, 2, 1, 0) for sp in (0, 1)],
    *[(1, ni, 1, 2, 1, 2, 1, 1) for ni in (64, 256)],
    *[(1, ni, 1, 2, reload, sets, 0, 1) for ni in (64, 128, 256)
      for reload, sets in ((5, 3), (5, 4), (2, 4), (2, 6), (3, 2), (4, 2))],
    *[(1, ni, 1, 2, 2, 6, 1, 1) for ni in (128, 256)],
]
NAMES = ("sparse", "ni", "chains", "wgs", "reload", "sets", "copy", "fresh_b")


def source(variant: tuple, dtype: str = "bf16") -> str:
    from kernelplan.kernels.nvrtc import cuda_source
    from kernelplan.kernels.sparse24_mma import defines

    sp, ni, chains, wgs, reload, sets, copy, fresh = variant
    head = defines(dtype, False, None, SPARSE=sp, NI=ni, CHAINS=chains, WGS=wgs, STEPS=STEPS, RELOAD=reload,
                   SETS=sets, COPY=copy, FRESH_B=fresh)

    return head + cuda_source("wgmma_rate.cu", HERE)


def measure(variant: tuple, src: str, sms: int) -> dict:
    import torch

    from kernelplan.kernels import nvrtc, raw_stream
    from kernelplan.kernels.direct import FunctionLaunch

    row = dict(zip(NAMES, variant))
    ni, chains, wgs = row["ni"], row["chains"], row["wgs"]
    threads = 128 * wgs + (128 if row["copy"] else 0)
    fn = nvrtc.function(src, "kp_wgmma_rate", 0, "sm_90a")
    from cuda.bindings import driver as cu
    cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SHARED)
    launch = FunctionLaunch(fn, "kp_wgmma_rate", ["*u16", "*fp32", "*i64"], threads, SHARED)
    src_buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # 1 MiB, read round and round from L2
    sink = torch.empty(sms * threads, dtype=torch.float32, device="cuda")
    out = torch.zeros(sms, 3, dtype=torch.int64, device="cuda")
    args = (src_buf.data_ptr(), sink.data_ptr(), out.data_ptr())
    stream = raw_stream(0)
    times = []
    for i in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch((sms, 1, 1), args, stream)
        end.record()
        torch.cuda.synchronize()
        if i:  # the first launch warms clocks and caches
            times.append(start.elapsed_time(end) * 1e-3)
    cycles = out[:, 0].double() / out[:, 1].double()
    per_step = statistics.median(cycles.tolist())
    fma = wgs * chains * 64 * ni * 64  # dense-equivalent multiply-adds a step, per CTA
    seconds = statistics.median(times)
    row.update(cycles_per_step=per_step, fma_per_cycle=fma / per_step,
               tflops=2 * fma * STEPS * sms / seconds / 1e12,
               copy_bytes_per_cycle=(float(out[:, 2].double().median()) / (per_step * STEPS)) if row["copy"] else 0.0)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="NVRTC-compile every variant for sm_90a")
    args = parser.parse_args()
    from kernelplan.kernels import nvrtc

    sources = [source(v) for v in VARIANTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # NVRTC compiles distinct programs in parallel
        list(pool.map(lambda s: nvrtc.cubin(s, "sm_90a"), sources))
    if args.compile_only:
        print(f"{len(sources)} variants compiled for sm_90a")
        return 0

    import torch

    from kernelplan.bench.results import write

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [measure(v, s, sms) for v, s in zip(VARIANTS, sources)]
    dense_best = max(r["fma_per_cycle"] for r in rows if not r["sparse"])
    print(f"{'kind':6} {'N':>4} {'chains':>6} {'wgs':>3} {'reload':>6} {'sets':>4} {'copy':>4} {'ring':>4} "
          f"{'cyc/step':>9} {'FMA/clk/SM':>10} {'x dense best':>12} {'TFLOP/s':>8} {'copy B/clk':>10}")
    for r in rows:
        print(f"{'sparse' if r['sparse'] else 'dense':6} {r['ni']:4} {r['chains']:6} {r['wgs']:3} {r['reload']:6} "
              f"{r['sets']:4} {r['copy']:4} {r['fresh_b']:4} {r['cycles_per_step']:9.1f} {r['fma_per_cycle']:10.0f} "
              f"{r['fma_per_cycle'] / dense_best:12.2f} {r['tflops']:8.0f} {r['copy_bytes_per_cycle']:10.1f}")
    write("wgmma-rate", {"steps": STEPS, "sms": sms, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
