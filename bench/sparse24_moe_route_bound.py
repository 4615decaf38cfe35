"""The MoE routing's host work: this tree's ``kernels/moe_route.route`` against an older copy of that module, in one
process, alternating by round (medians).

Since 4d37070 a call signature's launches are planned and bound once (``moe_route._Plan``); before, each launch went
through ``Launcher``, which keyed its compiled kernel by every argument's specialization on every call.  Give the
older module as a file (``--against``), e.g. ``git show 5354e45:src/kernelplan/kernels/moe_route.py > old.py``.

Two parts, on the published MoE configs of ``bench/sparse24_experts.py``:

* **route**: ``route`` alone on ``routed`` inputs (bf16, random top-k), host us a call (the clock stops when the
  last of 50 calls returns); each way's outputs checked equal, bit for bit;
* **module**: a ``Sparse24Experts`` eager call (``torch.inference_mode``) with each way's ``route``: host us, and
  wall us with the device's work waited for; the outputs checked equal, bit for bit.

Writes ``bench/results/sparse24-moe-route-bound-<gpu>.json``.

    git show 5354e45:src/kernelplan/kernels/moe_route.py > /tmp/old_route.py
    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) \\
        python bench/sparse24_moe_route_bound.py --against /tmp/old_route.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

import kernelplan.kernels.moe_route as this
from kernelplan.bench import results
from kernelplan.timing import host_us_per_call, interleaved
from sparse24_experts import MODELS, routed, sparse_calls


def older_module(path: str):
    """The module at ``path``, its package-relative imports made absolute, loaded under a name of its own."""
    source = open(path).read().replace("from . import ", "from kernelplan.kernels import ")
    spec = importlib.util.spec_from_loader("older_moe_route", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def route_part(older, models, token_counts, rounds: int) -> list[dict]:
    rows = []
    for model in models:
        experts, hidden, _, k = MODELS[model]
        for tokens in token_counts:
            x, index, weights = routed(tokens, hidden, experts, k)
            ids, w = index.contiguous(), weights.contiguous()
            y = x.new_empty(ids.numel(), hidden)
            got, want = this.route(ids, w, x, experts, y.clone()), older.route(ids, w, x, experts, y.clone())
            live = int(want[2][-1])  # rows past the experts' are left unwritten by both
            equal = torch.equal(got[0][:live], want[0][:live]) and all(map(torch.equal, got[1:], want[1:]))
            ways = {"bound": lambda: this.route(ids, w, x, experts, y),
                    "launcher": lambda: older.route(ids, w, x, experts, y)}
            us = interleaved({n: lambda f=f: host_us_per_call(f, x.device, 50, wait=False) for n, f in ways.items()},
                             rounds)
            rows.append({"part": "route", "model": model, "tokens": tokens, "host_us": us, "equal": equal,
                         "bound_over_launcher": us["bound"] / us["launcher"]})
            print(rows[-1], flush=True)
    return rows


def module_part(older, models, token_counts, rounds: int) -> list[dict]:
    rows = []
    bound = this.route
    for model, _, tokens, call in sparse_calls(models, token_counts):
        def way(route, call=call):
            def run():
                this.route = route  # Sparse24Experts imports route from the module at each call
                try:
                    return call()
                finally:
                    this.route = bound
            return run

        ways = {"bound": way(bound), "launcher": way(older.route)}
        cuda = torch.device("cuda")
        with torch.inference_mode():
            equal = torch.equal(ways["bound"](), ways["launcher"]())
            host = interleaved({n: lambda f=f: host_us_per_call(f, cuda, 20, wait=False) for n, f in ways.items()},
                               rounds)
            wall = interleaved({n: lambda f=f: host_us_per_call(f, cuda, 20) for n, f in ways.items()}, rounds)
        rows.append({"part": "module", "model": model, "tokens": tokens, "host_us": host, "wall_us": wall,
                     "equal": equal})
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="an older kernels/moe_route.py")
    ap.add_argument("--models", nargs="*", default=["Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V3"],
                    choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 128, 2048])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    older = older_module(a.against)
    rows = route_part(older, a.models, a.tokens, a.rounds)
    rows += module_part(older, a.models[:2], [t for t in a.tokens if t <= 128], a.rounds)
    results.write("sparse24-moe-route-bound", {"rows": rows}, a.out, against=a.against)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
