"""Host work of one eager 2:4 call beside ``F.linear``'s: host-bound calls back to back, and where the time goes.

A 1024x1024 bf16 layer at n = 1 (``--size``, ``--n``): the kernels take a few microseconds, so a
run of back-to-back calls is as long as the host work that launches them.
Timed alternating, medians of rounds: ``F.linear`` on the dense weight,
``nn.Linear``, ``kp.sparse24.linear`` on a public-format weight and on the device layout,
``Sparse24Linear`` (the device layout), under ``torch.no_grad`` and under
``torch.inference_mode``.  Then a cProfile of the module's calls, top
functions by own time.  Writes the medians to ``bench/results/sparse24-host-<gpu>.json``.

``--weights W`` cycles the calls over W layers of the same size (a model's many weights, as the sweep's eager
rows do), and ``--no-bias`` drops the bias (the sweep's F.linear has none).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_host.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.sweep import _cycling
from kernelplan.timing import host_us_per_call, interleaved


def per_call_us(fn, calls: int = 2000) -> float:
    return host_us_per_call(fn, torch.device("cuda"), calls)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--weights", type=int, default=1, help="layers the calls cycle over")
    ap.add_argument("--no-bias", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    s = a.size
    denses = [torch.nn.Linear(s, s, bias=not a.no_bias, device="cuda", dtype=torch.bfloat16)
              for _ in range(a.weights)]
    layers = [kp.nn.Sparse24Linear.from_dense(d) for d in denses]
    publics = [lay.weight24.public() for lay in layers]
    ws = [p.decompress() for p in publics]
    packeds = [p.packed() for p in publics]
    dense, layer, w = denses[0], layers[0], ws[0]
    x = torch.randn(a.n, s, device="cuda", dtype=torch.bfloat16)
    fns = {
        "F.linear": _cycling([lambda w=w, d=d: F.linear(x, w, d.bias) for w, d in zip(ws, denses)]),
        "nn.Linear": _cycling([lambda d=d: d(x) for d in denses]),
        "kp.sparse24.linear": _cycling([lambda p=p, d=d: kp.sparse24.linear(x, p, d.bias)
                                      for p, d in zip(publics, denses)]),
        "kp.sparse24.linear (device layout)": _cycling([lambda p=p, d=d: kp.sparse24.linear(x, p, d.bias)
                                                      for p, d in zip(packeds, denses)]),
        "Sparse24Linear": _cycling([lambda lay=lay: lay(x) for lay in layers]),
    }
    out = {}
    for mode, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with ctx():
            for fn in fns.values():
                fn()
            med = interleaved({n: (lambda fn=fn: per_call_us(fn)) for n, fn in fns.items()}, 7, 1)
        out[mode] = med
        base = med["F.linear"]
        print(f"{mode}: " + ", ".join(f"{n} {t:.1f} us ({t / base:.2f}x)" for n, t in med.items()), flush=True)
    with torch.no_grad():  # the layers of one module call, each timed alone
        from kernelplan.kernels import raw_stream
        from kernelplan.sparse24.format import _DERIVED
        from kernelplan.sparse24.gemm import _prepared

        call = next(hit.call for key, hit in _prepared.items() if key[0] == id(layer.values))
        tiled = next(v[1] for k, v in _DERIVED[id(layer.values)][1].items() if "launch" in str(k))
        y = torch.empty(a.n, s, device="cuda", dtype=torch.bfloat16)
        tiled(x, dense.bias, y)  # its launch for this x and y, looked up below
        launch, grid, _, _ = next(iter(tiled._calls.values()))
        bias_ptr = 0 if dense.bias is None else dense.bias.data_ptr()
        args = (x.data_ptr(), *tiled.weight, bias_ptr, y.data_ptr(), a.n, s, s, x.stride(0), y.stride(0))
        from kernelplan._checks import plain_eager
        from kernelplan.kernels import current_device, stream_capturing
        from kernelplan.plan import dispatch_generation
        from kernelplan.sparse24.gemm import GemmSparse24Plan

        parts = {
            "plain_eager": lambda: plain_eager(x, layer.values, dense.bias),
            "stream_capturing": stream_capturing,
            "current_device": current_device,
            "raw_stream": lambda: raw_stream(0),
            "dispatch_generation": lambda: dispatch_generation(GemmSparse24Plan),
            "torch.empty": lambda: torch.empty(a.n, s, device="cuda", dtype=torch.bfloat16),
            "x.new_empty": lambda: x.new_empty((a.n, s)),
            "cuLaunchKernel": lambda: launch(grid, args, raw_stream(0)),
            "_TiledWeight": lambda: tiled(x, dense.bias, y),
            "bound call": lambda: call(x, layer.values, layer.metadata, dense.bias),
            "linear_parts": lambda: kp.sparse24.gemm.linear_parts(x, layer.values, layer.metadata, dense.bias),
            "module": lambda: layer(x),
            "F.linear": lambda: F.linear(x, w, dense.bias),
            "module, cycled": fns["Sparse24Linear"],
            "F.linear, cycled": fns["F.linear"],
        }
        med = interleaved({n: (lambda fn=fn: per_call_us(fn)) for n, fn in parts.items()}, 5, 1)
        out["layers"] = med
        print("layers (no_grad): " + ", ".join(f"{n} {t:.1f} us" for n, t in med.items()), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5000):
            layer(x)
        prof.disable()
        torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    results.write("sparse24-host", out, a.json, size=s, n=a.n, weights=a.weights, bias=not a.no_bias,
                  unit="us per call, median of rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
