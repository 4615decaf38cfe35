"""Host work of an eager 2:4 call as a loop cycles over more weights, beside torch's, and in which layer it grows.

The sweep's eager rows cycle over as many copies of a weight as take its reads past the L2 (up to 256: a model's
many layers). For each layer size, n and number of weights cycled, host time alone per call (the clock stops when
the last call returns; ``timing.host_us_per_call(wait=False)``), alternating in rounds, medians:

* ``F.linear`` on the dense weights and ``kp.sparse24.linear`` on their 2:4 copies (the device layout, no bias, as
  the sweep calls them); ``nn.Linear`` modules on the dense weights and ``Sparse24Linear`` ones;
* ``direct``: the fast-path entry's ``DirectCall`` called directly (``kernels/sparse24_mma.py``: its checks, y's
  allocation, the bound launch), the layers under ``kp.sparse24.linear`` and its fast path's entry;
* ``bound``: the weight's ``BoundLaunch`` called directly (``kernels/direct.py``: x's, bias's and y's slots
  written, ``cuLaunchKernel``), the layer under every lookup;
* ``y``: ``x.new_empty`` of y alone;
* ``kp.sparse24.linear (table lookup)``: on other copies of the weights whose fast-path entries call the weight's
  ``_TiledWeight.linear`` (its table of launches by x's shape), as before the ``DirectCall`` (docs/design/0071): the
  two side by side in one process (``--lookup``);
* ``..._no_driver``: ``kp.sparse24.linear``, ``direct`` and ``bound`` with ``cuLaunchKernel`` replaced by a no-op,
  so the Python layers alone (nothing runs on the GPU then).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_host_weights.py \\
        [--shape MxK ...] [--n 1 128] [--weights 1 256] [--lookup]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.sweep import _cycling
from kernelplan.timing import host_us_per_call

CALLS = 50  # as the sweep's EAGER_CALLS


def direct_call(w24, x):
    """The ``DirectCall`` of the fast-path entry an eager call on ``w24`` with this x made (after one call)."""
    from kernelplan.sparse24 import gemm

    key = next(key for key in gemm._prepared if key[0] == id(w24.values) and key[1] == x.shape)
    return gemm._prepared[key].call


@contextlib.contextmanager
def table_lookup():
    """Fast-path entries made inside call the weight's ``_TiledWeight.linear``, as before the ``DirectCall``."""
    from kernelplan.kernels.sparse24_mma import MmaLinear

    held = MmaLinear.held
    MmaLinear.held = lambda self, values, metadata: functools.partial(self._weight(values, metadata).linear, self)
    try:
        yield
    finally:
        MmaLinear.held = held


def read(fns: dict, rounds: int, dev) -> dict[str, float]:
    from cuda.bindings import driver as cu

    launch, noop = cu.cuLaunchKernel, (lambda *a: (cu.CUresult.CUDA_SUCCESS,))
    reads: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            reads.setdefault(name, []).append(host_us_per_call(fn, dev, CALLS, wait=False))
        cu.cuLaunchKernel = noop  # the module's attribute: every launch here reads it per call
        try:
            for name in ("kp.sparse24.linear", "direct", "bound"):
                reads.setdefault(f"{name}_no_driver", []).append(host_us_per_call(fns[name], dev, CALLS, wait=False))
        finally:
            cu.cuLaunchKernel = launch
    return {name: statistics.median(v) for name, v in reads.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="*", default=["320x960", "768x768", "4096x4096"])
    ap.add_argument("--n", type=int, nargs="*", default=[1, 128])
    ap.add_argument("--weights", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--lookup", action="store_true", help="also time calls whose entries look their launch up")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for shape in a.shape:
            m, k = map(int, shape.split("x"))
            most = max(a.weights)
            ws = [kp.sparse24.prune(torch.randn(m, k, device=dev)).bfloat16() for _ in range(most)]
            denses = [torch.nn.Linear(k, m, bias=False, device="meta") for _ in range(most)]
            for d, w in zip(denses, ws):
                d.weight = torch.nn.Parameter(w, requires_grad=False)  # the dense weights themselves, no copy
            layers = [kp.nn.Sparse24Linear.from_dense(d) for d in denses]
            w24s = [kp.sparse24.compress(w).packed() for w in ws]
            looked = [kp.sparse24.compress(w).packed() for w in ws] if a.lookup else []
            for n in a.n:
                x = torch.randn(n, k, device=dev).bfloat16()
                y = x.new_empty(n, m)
                for w24 in w24s:
                    kp.sparse24.linear(x, w24)
                with table_lookup():
                    for w24 in looked:
                        kp.sparse24.linear(x, w24)
                directs = [direct_call(w24, x) for w24 in w24s]
                bounds = [d.kept[0] for d in directs]  # each DirectCall's kept launch
                stream = torch.cuda.current_stream().cuda_stream
                for weights in a.weights:
                    fns = {
                        "F.linear": _cycling([lambda w=w: F.linear(x, w) for w in ws[:weights]]),
                        "kp.sparse24.linear": _cycling([lambda c=c: kp.sparse24.linear(x, c) for c in w24s[:weights]]),
                        "nn.Linear": _cycling([lambda d=d: d(x) for d in denses[:weights]]),
                        "Sparse24Linear": _cycling([lambda lay=lay: lay(x) for lay in layers[:weights]]),
                        "direct": _cycling([lambda d=d, c=c: d(x, c.values, c.metadata, None)
                                            for d, c in zip(directs[:weights], w24s)]),
                        "bound": _cycling([lambda b=b: b(x.data_ptr(), 0, y.data_ptr(), stream)
                                           for b in bounds[:weights]]),
                        "y": lambda: x.new_empty(n, m),
                    }
                    if looked:
                        fns["kp.sparse24.linear (table lookup)"] = _cycling(
                            [lambda c=c: kp.sparse24.linear(x, c) for c in looked[:weights]])
                    row = {"m": m, "k": k, "n": n, "weights": weights, **read(fns, a.rounds, dev)}
                    rows.append(row)
                    print(f"{m}x{k} n={n} weights={weights}: " + ", ".join(
                        f"{name} {v:.2f}" for name, v in row.items() if isinstance(v, float)), flush=True)
            del ws, w24s, looked, denses, layers, directs, bounds
            torch.cuda.empty_cache()
    results.write("sparse24-host-weights", {"rows": rows}, a.json, calls=CALLS, rounds=a.rounds,
                  unit="us of host work per call, median of rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
