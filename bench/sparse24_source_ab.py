"""The small-n kernels (``cuda_sp``, ``cuda_mma``) built from this tree's sources against another checkout's, side by
side, at the rule's tile of every problem.

Why: a change to a kernel's source that should not change what it does can still change the SASS that ptxas
makes (docs/design/0052: the copy macros written as lambdas moved registers and the order of address arithmetic).
Two builds of one tile, the same weights and x: their y must agree bit for bit (the sums run in the same order),
and their times are read in one set of CUDA graph rounds with dense ``F.linear`` (``timing.graph_rounds``:
alternating order, weights read past the L2).

The other checkout's sources come from its own ``kernelplan`` (``--base``, a ``src`` folder), imported in a
subprocess: each kernel's ``source(cfg, dtype, bias, activation)`` as that checkout wrote it.  Writes
``bench/results/sparse24-source-ab-<gpu>.json``: per row both builds' median ms, dense's, and new over base.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_source_ab.py \
        --base old/src
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import torch

from kernelplan.bench import results
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.bench.sweep import copies_past_l2
from kernelplan.kernels import nvrtc, raw_stream, sparse24_mma, sparse24_sp
from kernelplan.kernels.sparse24 import sm_count
from kernelplan.sparse24.tiles import calls_per_replay
from kernelplan.sparse24 import compress, prune
from kernelplan.timing import graph_rounds
from sparse24_tile_tuning import dense_calls

# kernel: (module, the largest n of one launch)
KERNELS = {"sp": (sparse24_sp, sparse24_sp.MAX_N), "mma": (sparse24_mma, sparse24_mma.MAX_N)}

_BASE_SCRIPT = """
import json, sys
from kernelplan.kernels import sparse24_mma, sparse24_sp
mods = {"sp": (sparse24_sp, sparse24_sp.SpConfig), "mma": (sparse24_mma, sparse24_mma.MmaConfig)}
out = []
for kernel, fields, dtype in json.load(sys.stdin):
    mod, cls = mods[kernel]
    out.append(mod.source(cls(**fields), dtype, False, None))
json.dump(out, sys.stdout)
"""


def base_sources(base: str, variants: list) -> list[str]:
    """Each ``(kernel, cfg, dtype)``'s source as the checkout whose ``src`` folder is ``base`` writes it."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(base))
    spec = [(kernel, dataclasses.asdict(cfg), dtype) for kernel, cfg, dtype in variants]
    got = subprocess.run([sys.executable, "-c", _BASE_SCRIPT], input=json.dumps(spec), capture_output=True,
                         text=True, env=env, cwd=os.path.abspath(base))
    if got.returncode:
        raise SystemExit(f"--base {base}: its kernelplan could not write the sources:\n{got.stderr[-2000:]}")
    return json.loads(got.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other checkout's src folder (its kernelplan package)")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 16, 32, 64])
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--kernel", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype, name = torch.bfloat16, "bf16"
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else list(sweep_shapes())
    sms, limit = sm_count(0), nvrtc.shared_per_block(0)
    rule = {"sp": lambda n, m, k: sparse24_sp.fit_shared(sparse24_sp.sp_config(n, m, k, sms), limit),
            "mma": lambda n, m, k: sparse24_mma.mma_config(n, m, k, sms)}
    problems = {(m, k): [(kernel, n, rule[kernel](n, m, k)) for kernel in a.kernel for n in a.batch
                         if n <= KERNELS[kernel][1]] for m, k in shapes}
    variants = list(dict.fromkeys((kernel, cfg, name) for ps in problems.values() for kernel, _, cfg in ps))
    base = dict(zip(variants, base_sources(a.base, variants)))
    texts = {v: (KERNELS[v[0]][0].source(v[1], name, False, None), base[v]) for v in variants}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # NVRTC is thread-safe; the launches below load
        arch = nvrtc.arch(0)
        list(pool.map(lambda t: nvrtc.cubin(t, arch), [t for pair in texts.values() for t in pair]))
    launches = {(kernel, cfg): (KERNELS[kernel][0].launch_of(cfg, new, 0, f"{cfg} new"),
                                KERNELS[kernel][0].launch_of(cfg, old, 0, f"{cfg} base"), new == old)
                for (kernel, cfg, _), (new, old) in texts.items()}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for (m, k), todo in problems.items():
        copies = copies_past_l2(l2, m * k * 9 // 8, "cold")
        public = [compress(prune(torch.randn(m, k, device="cuda")).to(dtype)) for _ in range(copies)]
        held = {kernel: [KERNELS[kernel][0]._tiled(w.values, w.metadata) for w in public] for kernel in a.kernel}
        del public
        for kernel, n, cfg in todo:
            weights = held[kernel]
            x = torch.randn(n, k, device="cuda").to(dtype)
            new, old, same_text = launches[kernel, cfg]
            grid = (-(-m // (cfg.rows if kernel == "sp" else 16)), 1, 1)
            ys = {side: torch.empty(n, m, device="cuda", dtype=dtype) for side in ("new", "base")}

            def calls(launch, y):
                # The stream is read at each call: under capture it is the graph's.
                return [lambda p=p, c=c: launch(grid, (x.data_ptr(), p.data_ptr(), c.data_ptr(), 0, y.data_ptr(), n,
                                                       m, k, x.stride(0), y.stride(0)), raw_stream(0))
                        for p, c in weights]

            fns = {"new": calls(new, ys["new"]), "base": calls(old, ys["base"]), "dense": dense_calls(n, m, k, dtype)}
            for side in ("new", "base"):
                ys[side].fill_(float("nan"))
                fns[side][0]()
            torch.cuda.synchronize()
            if not torch.equal(ys["new"], ys["base"]):
                raise SystemExit(f"{kernel} {m}x{k} n = {n} {cfg}: the two builds' y differ")
            ms = {side: statistics.median(t) for side, t in
                  graph_rounds(fns, calls_per_replay(n, m, k), a.rounds).items()}
            row = {"kernel": kernel, "m": m, "k": k, "n": n, "cfg": str(cfg), "same_source": same_text,
                   "new_ms": ms["new"], "base_ms": ms["base"], "dense_ms": ms["dense"],
                   "new_over_base": ms["new"] / ms["base"], "new_speedup": ms["dense"] / ms["new"]}
            if row["new_speedup"] > 2 or ms["dense"] / ms["base"] > 2:  # 2:4 halves the bytes and the products
                raise SystemExit(f"{kernel} {m}x{k} n = {n}: {row['new_speedup']:.2f}x of dense is past 2:4's 2x, "
                                 "so the replays did not time the kernels")
            rows.append(row)
            print(f"{kernel:3s} {m:6d} x {k:<6d} n={n:3d} new {ms['new'] * 1e3:7.2f} us base {ms['base'] * 1e3:7.2f} "
                  f"us  new/base {row['new_over_base']:.3f}  {row['new_speedup']:.2f}x dense", flush=True)
        del held
        torch.cuda.empty_cache()
        results.write("sparse24-source-ab", {"rows": rows}, a.out, dtype=name, batch=a.batch, rounds=a.rounds,
                      base=a.base, kernels=a.kernel)
    for kernel in a.kernel:
        got = [r["new_over_base"] for r in rows if r["kernel"] == kernel]
        if got:
            gm = math.exp(statistics.mean(math.log(v) for v in got))
            print(f"{kernel}: {len(got)} problems, new over base: geometric mean {gm:.4f}, min {min(got):.3f}, "
                  f"max {max(got):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
