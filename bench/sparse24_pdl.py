"""Programmatic dependent launch with W's first loads ahead of the wait (``sparse24_ws.cu``'s EARLY_W): how much of the
2:4 kernel's fixed cost it hides where the kernel follows another one, as in a model's forward (docs/design/0022).

A chain of L square layers replayed as one CUDA graph: ``h <- linear_i(h * g)``.  The multiply is torch's elementwise
kernel; it writes the linear's x, as a norm does before a projection.  Each layer has its own weight, so the weights
come from DRAM.  Three chains, timed alternately in one process:
* dense ``F.linear``;
* the rule's ``cuda_ws`` tile;
* the same tile compiled with EARLY_W and launched with programmatic stream serialization (``cuLaunchKernelEx``).

Checks before timing: the PDL chain's output equals the plain 2:4 chain's bit for bit, since a read of x before its
writer finished would change it; both are compared with an fp64 chain.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_pdl.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

from kernelplan.bench import results
from kernelplan.kernels import nvrtc, raw_stream
from kernelplan.kernels.direct import _param_buffers, _stream
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels.sparse24_ws import MapLaunch, TensorMaps, WsKernel, source, ws_config
from kernelplan.sparse24 import compress, prune

SIZES = (3584, 4096, 8192)
BATCH = (1, 16, 64)


class PdlLaunch:
    """``launch``'s kernel compiled with EARLY_W and launched with programmatic stream serialization."""

    def __init__(self, cfg, n: int, m: int, dtype: str, device: int, early: int, attribute: bool = True):
        from cuda.bindings import driver as cu

        plain, self.grid = WsKernel().launch_config(cfg, n, m, dtype, False, None, device)
        fn = nvrtc.function(source(cfg, dtype, False, None, early_w=early), "kp_sparse24_ws", device,
                            WsKernel.architecture)
        err, = cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     cfg.shared)
        assert not err, err
        self.launch = MapLaunch(fn, f"early-W {cfg}", cfg, TensorMaps(cfg.bn // cfg.cm, 4 * cfg.wm, dtype), device)
        self.plain, self.cu = plain, cu
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        self.attr, self.attribute = attr, attribute

    def __call__(self, args: tuple, stream: int) -> None:
        cu, launch = self.cu, self.launch
        storage, _, address = buffers = _param_buffers(bytes(max(launch.size, 8)), launch._offsets)
        launch.pack(storage, 0, *launch._mapped(args))
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = launch.block, 1, 1
        config.sharedMemBytes, config.hStream = launch.shared, _stream(cu, stream)
        config.attrs, config.numAttrs = ([self.attr], 1) if self.attribute else ([], 0)
        err, = cu.cuLaunchKernelEx(config, launch.function, address, 0)
        assert not err, err
        del buffers  # the driver copied the parameters


def chain(size: int, n: int, layers: int, dtype=torch.bfloat16):
    """Three ``run(h)`` of the same chain (dense, 2:4, 2:4 with PDL) and its fp64 oracle."""
    ws = [prune(torch.randn(size, size, device="cuda") / (size / 2) ** 0.5).to(dtype) for _ in range(layers)]
    tiled = [_tiled(w24.values, w24.metadata) for w24 in map(compress, ws)]
    gains = [torch.rand(size, device="cuda").to(dtype) + 0.5 for _ in range(layers)]
    cfg = ws_config(n, size, size, sm_count(0))
    plain, grid = WsKernel().launch_config(cfg, n, size, "bf16", False, None, 0)
    launches = {"2:4": lambda args, stream: plain(grid, args, stream)}
    if not (cfg.pp or cfg.sk):  # EARLY_W is built in the one-a-tile kernel
        launches["early ring, no PDL"] = PdlLaunch(cfg, n, size, "bf16", 0, cfg.stages, attribute=False)
        for early in sorted({1, 2, cfg.stages}):
            launches[f"PDL early {early}"] = PdlLaunch(cfg, n, size, "bf16", 0, early)
    ys = [torch.empty(n, size, device="cuda", dtype=dtype) for _ in range(layers)]

    def sparse(h, launch):
        for (pairs, codes), g, y in zip(tiled, gains, ys):
            x = h * g
            launch((x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), 0, y.data_ptr(), n, size, size, x.stride(0),
                    y.stride(0)), raw_stream(0))
            h = y
        return h

    def dense(h):
        for w, g in zip(ws, gains):
            h = F.linear(h * g, w)
        return h

    def oracle(h):
        for w, g in zip(ws, gains):
            h = F.linear(h.double() * g.double(), w.double()).to(dtype).double()  # each layer's output rounded
        return h

    runs = {"dense": dense, **{name: lambda h, launch=launch: sparse(h, launch) for name, launch in launches.items()}}
    return runs, oracle, cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    ap.add_argument("--batch", type=int, nargs="*", default=BATCH)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for size in a.sizes:
        for n in a.batch:
            runs, oracle, cfg = chain(size, n, a.layers)
            h0 = torch.randn(n, size, device="cuda").bfloat16()
            want = oracle(h0)
            out = {name: run(h0).clone() for name, run in runs.items()}
            scale = float(want.abs().max())
            errs = {name: float((o.double() - want).abs().max()) / scale for name, o in out.items()}
            same = all(torch.equal(o, out["2:4"]) for name, o in out.items() if name != "dense")
            times = {name: [] for name in runs}
            for r in range(a.rounds):
                for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    times[name].append(triton.testing.do_bench_cudagraph(lambda: runs[name](h0), rep=40,
                                                                          return_mode="median"))
            med = {name: statistics.median(t) * 1e3 / a.layers for name, t in times.items()}  # us per layer
            row = {"m": size, "k": size, "n": n, "layers": a.layers, "config": str(cfg), "us_per_layer": med,
                   "rel_err": errs, "bitwise_equal_to_plain": same,
                   "dense_bytes": size * size * 2, "sparse_bytes": size * size * 2 * 9 // 16}
            rows.append(row)
            print(f"{size:5d}^2 n={n:4d} dense {med['dense']:6.2f} us  " + "  ".join(
                f"{name} {t:6.2f} ({med['dense'] / t:.2f}x)" for name, t in med.items() if name != "dense")
                + f"  bitwise {same}  err {max(errs.values()):.1e}  {cfg}", flush=True)
            if not same or max(errs.values()) > 0.05:
                print("WRONG RESULT", errs, flush=True)
    results.write("sparse24-pdl", {"rows": rows}, a.out, timing="CUDA graph of the chain, "
                  "triton.testing.do_bench_cudagraph median, rounds alternating, per layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
