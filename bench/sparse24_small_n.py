"""The two tiled kernels of the one layout at small n, side by side: every ``cuda_sp`` tile (``sp_candidates``), the
rule's first ``cuda_ws`` tiles, and dense ``F.linear``, over the sweep set (or ``--shape``) at each n of ``--batch``.

What the Hopper boundary between the two kernels (``dispatch.backend_for``) and ``cuda_sp``'s tile rule at
n <= 16 (``sp_config``) are read from (docs/design/0042).  All of a problem's kernels are timed in one set of CUDA
graph rounds (``timing.graph_rounds``: alternating order, weights read past the L2), each kernel's result checked
against the first's.  Writes ``bench/results/sparse24-small-n-<gpu>.json``: per row the median ms of every tile
(``tiles_ms``, by its repr), dense's, the rule's backend and each kernel's rule pick.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_small_n.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from kernelplan.bench import results
from kernelplan.bench.shapes import lm_head_shapes, sweep_shapes
from kernelplan.sparse24 import tiles
from kernelplan.timing import graph_rounds
from sparse24_tile_tuning import dense_calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 16])
    ap.add_argument("--lm-heads", action="store_true",
                    help="the LM heads of the sweep set's models (bench/shapes.py, lm_head_shapes) instead, held out of "
                         "the rules' fits (docs/design/0052)")
    ap.add_argument("--shape", nargs="*", default=None, metavar="MxK")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ws-top", type=int, default=4, help="cuda_ws's first tiles by its rule's cost")
    ap.add_argument("--wide-split", action="store_true",
                    help="cuda_ws tiles wider than n needs, with K split across a cluster of bn / 8 CTAs (3, 4 or 8)")
    ap.add_argument("--persistent-split", action="store_true",
                    help="cuda_ws's persistent tiles with K split to fill every SM (sk_plan), 1 and 2 row blocks of W")
    ap.add_argument("--sp-top", type=int, default=None, help="cuda_sp's first tiles (default: all)")
    ap.add_argument("--sp-stages", action="store_true",
                    help="each of those cuda_sp tiles at every ring depth of 2 to 6 steps that fits beside its "
                         "resident CTAs (min_blocks), not only at the depth its rule gives it")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.bfloat16
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shape] if a.shape else list(sweep_shapes())
    if a.lm_heads:
        shapes = list(lm_head_shapes())
    from kernelplan.kernels.gpu_facts import device_facts
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_sp import SM_SHARED, sp_candidates
    from kernelplan.sparse24.dispatch import backend_for

    sms, cap = sm_count(0), torch.cuda.get_device_capability(0)
    gpu = device_facts(0) if cap >= (9, 0) else None  # the device's own rule (docs/design/0065)

    def wide_split(n, m, k):
        """Tiles of 24, 32 or 64 rows of x (n needs 16) so that K splits across a cluster of 3, 4 or 8 CTAs (each
        writes 8 rows of y): more CTAs, more of the weight in flight, where a grid of 16-row tiles fills under an SM
        each."""
        from kernelplan.kernels.sparse24_ws_rule import _deepest, small_n_splits

        # The rule's own (over 3 and 4, at n <= 16), and 64 rows over 8 wherever n needs fewer rows of x.
        wider = [c for wm in (1, 2) if 64 > -(-n // 16) * 16 and k // 64 >= 32 and (c := _deepest(64, wm, 1, 8))]
        return small_n_splits(n, k) + wider

    def persistent_split(n):
        """The persistent tiles of x's fitted rows whose launch splits the weight's row blocks along K into parts
        spread evenly over every SM (``sk_plan``): a grid of one-a-tile CTAs fills fewer than the SMs at small n."""
        from kernelplan.kernels.sparse24_ws_rule import _deepest

        return [c for wm in (1, 2) if (c := _deepest(-(-n // 16) * 16, wm, 1, 1, sk=True)) is not None]

    def sp_tiles(n, m, k):
        got = sp_candidates(n, m, k, sms)[:a.sp_top]
        if a.sp_stages:  # the rule's pick first, as tile_calls checks the others against it
            got = list(dict.fromkeys(got + [dataclasses.replace(c, stages=s) for c in got for s in range(2, 7)
                                            if c.min_blocks * (dataclasses.replace(c, stages=s).shared + 1024)
                                            <= SM_SHARED + 1024]))
        return got

    def cands(n, m, k):
        return sp_tiles(n, m, k) + tiles.candidates(n, m, k, sms, False, a.ws_top, "cuda_ws", gpu) \
            + (wide_split(n, m, k) if a.wide_split else []) + (persistent_split(n) if a.persistent_split else [])

    t0 = time.perf_counter()
    tiles.compile_all([(c, "bf16", None) for m, k in shapes for n in a.batch for c in cands(n, m, k)], 0)
    compile_s = time.perf_counter() - t0
    rows = []
    for m, k in shapes:
        for n in a.batch:
            cs = cands(n, m, k)
            fns = {str(c): f for c, f in tiles.tile_calls(cs, n, m, k, dtype, None, 0).items()}
            fns["dense"] = dense_calls(n, m, k, dtype)
            ms = {name: statistics.median(t) for name, t in
                  graph_rounds(fns, tiles.calls_per_replay(n, m, k), a.rounds).items()}
            dense = ms.pop("dense")
            sp_rule, ws_rule = str(cs[0]), str(tiles.candidates(n, m, k, sms, False, 1, "cuda_ws", gpu)[0])
            sp = {c: t for c, t in ms.items() if c.startswith("SpConfig")}
            ws = {c: t for c, t in ms.items() if c.startswith("WsConfig")}
            row = {"m": m, "k": k, "n": n, "rule": backend_for(cap, n, m, k, "bf16"), "dense_ms": dense,
                   "sp_rule": sp_rule, "ws_rule": ws_rule, "tiles_ms": ms, "dropped": len(cs) - len(ms)}
            best_sp, best_ws = min(sp, key=sp.get), min(ws, key=ws.get)
            row |= {"sp_rule_speedup": dense / ms[sp_rule] if sp_rule in ms else None,
                    "ws_rule_speedup": dense / ms[ws_rule] if ws_rule in ms else None,
                    "sp_best": best_sp, "sp_best_speedup": dense / sp[best_sp],
                    "ws_best": best_ws, "ws_best_speedup": dense / ws[best_ws]}
            rows.append(row)
            print(f"{m:6d} x {k:<6d} n={n:3d} {row['rule']:8s} dense {dense * 1e3:7.1f} us  ws rule "
                  f"{row['ws_rule_speedup'] or 0:.3f}x best {row['ws_best_speedup']:.3f}x  sp rule "
                  f"{row['sp_rule_speedup'] or 0:.3f}x best {row['sp_best_speedup']:.3f}x {best_sp}", flush=True)
        torch.cuda.empty_cache()
        # After each shape, so that a run cut off by a time limit keeps what it measured.
        results.write("sparse24-small-n", {"rows": rows, "compile_s": compile_s}, a.out, dtype="bf16",
                      batch=a.batch, rounds=a.rounds, ws_top=a.ws_top, sms=sms, wide_split=a.wide_split,
                      persistent_split=a.persistent_split, sp_stages=a.sp_stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
