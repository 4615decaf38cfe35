"""A ``Sparse24Experts`` call compiled in the default mode: its grouped kernels as ops with no autograd formula
(``nn/experts_ops.py``, since 0078) against the same bodies as ``torch.library.custom_op`` ops (what 2f41b16 had),
in one process.

In the default mode a compiled graph calls each op through the dispatcher on every call, so an op's own host work is
the call's: custom_op adds its Python autograd and aliasing layers even where no gradient is needed.  For published
configs at a decode's token counts, the module compiled each way (and eager, for scale) runs in rounds that alternate
the ways; per call: host work alone (20 calls, the clock stopped when the last returns) and wall time (20 calls
waited for).  Each compiled way's output is checked against eager's, bit for bit (the same kernels).

Writes ``bench/results/sparse24-experts-compiled-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_experts_compiled.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Optional

import torch

from kernelplan.bench import results
from kernelplan.nn import experts_ops
from kernelplan.timing import host_us_per_call

from sparse24_experts import MODELS, sparse_calls


def _custom_ops() -> dict:
    """The experts' three ops as custom_op ops on the same bodies, under the namespace ``kpbench``."""
    ops = experts_ops

    @torch.library.custom_op("kpbench::moe_route", mutates_args=("y",))
    def moe_route(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, experts: int,
                  y: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return ops._route(ids, weights, x, experts, y)

    @torch.library.custom_op("kpbench::grouped_linear", mutates_args=())
    def grouped_linear(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: Optional[torch.Tensor],
                       offsets: torch.Tensor, experts: int, epilogue: Optional[str]) -> torch.Tensor:
        return ops._grouped(x, values, metadata, bias, offsets, experts, epilogue)

    @torch.library.custom_op("kpbench::grouped_linear_scatter", mutates_args=("y",))
    def grouped_linear_scatter(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor,
                               bias: Optional[torch.Tensor], offsets: torch.Tensor, experts: int, y: torch.Tensor,
                               rows: torch.Tensor, scale: torch.Tensor) -> None:
        ops._scatter(x, values, metadata, bias, offsets, experts, y, rows, scale)

    moe_route.register_fake(ops._route_fake)
    grouped_linear.register_fake(ops._grouped_fake)
    grouped_linear_scatter.register_fake(ops._scatter_fake)
    return {"moe_route": moe_route, "grouped_linear": grouped_linear, "grouped_linear_scatter": grouped_linear_scatter}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["Mixtral-8x7B", "Qwen3-30B-A3B", "OLMoE-1B-7B"],
                    choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="*", default=(1, 16, 64))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    torch.manual_seed(0)
    # Each module, token count and way is its own compiled entry of the experts' forward.
    torch._dynamo.config.recompile_limit = 4 * len(a.models) * len(a.tokens)
    ways = {"inference op": {n: getattr(experts_ops, n) for n in ("moe_route", "grouped_linear",
                                                                  "grouped_linear_scatter")},
            "custom_op": _custom_ops()}
    cuda = torch.device("cuda")
    rows = []
    for model, (count, hidden, _, k), tokens, call in sparse_calls(a.models, a.tokens):
        module, args = call.func, call.args
        compiled = torch.compile(module, dynamic=False)

        def run(way: str):
            if way == "eager":
                return module(*args)
            for name, op in ways[way].items():  # read by the forward as it traces; dynamo guards which it read
                setattr(experts_ops, name, op)
            return compiled(*args)

        host, wall, outs = {}, {}, {}
        with torch.no_grad():
            order = ["eager", *ways]
            for way in order:
                outs[way] = run(way).clone()
            for r in range(a.rounds):
                for way in order[r % 3:] + order[:r % 3]:
                    fn = lambda way=way: run(way)  # noqa: E731
                    for _ in range(3):
                        fn()
                    host.setdefault(way, []).append(host_us_per_call(fn, cuda, 20, wait=False))
                    wall.setdefault(way, []).append(host_us_per_call(fn, cuda, 20, wait=True))
        for name, op in ways["inference op"].items():
            setattr(experts_ops, name, op)
        row = {"model": model, "experts": count, "hidden": hidden, "top_k": k, "tokens": tokens,
               "host_us": {w: statistics.median(v) for w, v in host.items()},
               "wall_us": {w: statistics.median(v) for w, v in wall.items()},
               "bitwise_equal_to_eager": {w: torch.equal(outs[w], outs["eager"]) for w in ways}}
        rows.append(row)
        print(f"{model:15s} T={tokens:4d}  host us " + "  ".join(f"{w} {v:6.1f}" for w, v in row["host_us"].items())
              + "  wall us " + "  ".join(f"{w} {v:6.1f}" for w, v in row["wall_us"].items())
              + ("" if all(row["bitwise_equal_to_eager"].values()) else "  NOT EQUAL"), flush=True)
    results.write("sparse24-experts-compiled", {"rows": rows}, a.out, dtype="bf16", mode="default",
                  timing="one process; ways alternating by round; host: 20 calls, the clock stopped when the last "
                         "returned; wall: 20 calls waited for; medians of rounds")
    return 0 if all(all(r["bitwise_equal_to_eager"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
