"""A ``Sparse24Experts`` call compiled in the default mode: its grouped kernels as ops with no autograd formula
(``nn/experts_ops.py``, since 0078) against the same bodies as ``torch.library.custom_op`` ops (what 2f41b16 had),
in one process.

In the default mode a compiled graph calls each op through the dispatcher on every call, so an op's own host work is
the call's: custom_op adds its Python autograd and aliasing layers even where no gradient is needed.  For published
configs at a decode's token counts:

* each op called alone as a compiled graph calls it, each way on the same operands, under no_grad and under
  inference_mode, in rounds that alternate the ways: host work per call (50 calls, the clock stopped when the last
  returns);
* the module compiled in the default mode against eager, for scale: wall time per call (20 calls waited for); then
  compiled with ``mode="reduce-overhead"`` (a CUDA graph replayed) against eager, dynamo's entries reset between;
  each compiled output against eager's, bit for bit (the same kernels).

(Compiling the module once per way and switching between them in one process measured dynamo's cache lookup, which
checks the guards of the entry it misses first: not kept.)

Writes ``bench/results/sparse24-experts-compiled-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_experts_compiled.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from kernelplan.bench import results
from kernelplan.nn import experts_ops
from kernelplan.timing import host_us_per_call, interleaved

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


def _op_calls(module, args) -> dict:
    """Each op's call as a compiled graph makes it (positional, no autograd needed), on what ``module(*args)``'s grouped
    forward passes: ``{op name: (args for the inference op, args for custom_op's)}``."""
    hidden, index, weights = args
    experts = module.num_experts
    scatter = hidden.new_empty(index.numel(), module._out)
    xs, order, offsets, scale = experts_ops.moe_route(index.contiguous(), weights.contiguous(), hidden, experts,
                                                      scatter)
    first, down = module._span(module.first), module._span(module.down)
    h = experts_ops.grouped_linear(xs, *first, offsets, experts, module._epilogue)
    return {"moe_route": (index.contiguous(), weights.contiguous(), hidden, experts, scatter),
            "grouped_linear": (xs, *first, offsets, experts, module._epilogue),
            "grouped_linear_scatter": (h.contiguous(), *down, offsets, experts, scatter, order, scale)}


def _walls(modes: dict, rounds: int, cuda: torch.device) -> dict:
    """Wall us a call of each mode (20 calls waited for), in alternating rounds: medians."""
    return interleaved({m: lambda fn=fn: host_us_per_call(fn, cuda, 20) for m, fn in modes.items()}, rounds)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["Mixtral-8x7B", "Qwen3-30B-A3B", "OLMoE-1B-7B"],
                    choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="*", default=(1, 16, 64))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 2 * len(a.models) * len(a.tokens)
    custom = _custom_ops()
    cuda = torch.device("cuda")
    rows = []
    for model, (count, hidden, _, k), tokens, call in sparse_calls(a.models, a.tokens):
        module, args = call.func, call.args
        compiled = torch.compile(module, dynamic=False)
        row = {"model": model, "experts": count, "hidden": hidden, "top_k": k, "tokens": tokens}
        with torch.no_grad():
            # The ops alone, each way on the same operands, under both contexts a compiled graph may run in.
            calls = _op_calls(module, args)
            for context in ("no_grad", "inference_mode"):
                ways = {f"{name} {way}": (lambda op=op, a=a: op(*a))
                        for name, a in calls.items()
                        for way, op in (("inference op", getattr(experts_ops, name)), ("custom_op", custom[name]))}
                with torch.inference_mode(context == "inference_mode"):
                    row[f"op_host_us_{context}"] = interleaved(
                        {w: lambda fn=fn: host_us_per_call(fn, cuda, 50, wait=False) for w, fn in ways.items()},
                        a.rounds)
            # The module compiled in the default mode (its ops as it has them) against eager, for scale.
            want = module(*args).clone()
            got = compiled(*args).clone()
            row["module_wall_us"] = _walls({"eager": lambda: module(*args), "compiled": lambda: compiled(*args)},
                                           a.rounds, cuda)
            # Then with mode="reduce-overhead" (the launches replayed as a CUDA graph), beside eager again: dynamo's
            # entries reset first, so that no call passes the other mode's guards before it finds its own.
            torch._dynamo.reset()
            replayed = torch.compile(module, mode="reduce-overhead", dynamic=False)
            for _ in range(3):  # cudagraph trees warm up, then record
                got_replayed = replayed(*args).clone()
            row["module_wall_us_reduce_overhead"] = _walls(
                {"eager": lambda: module(*args), "reduce-overhead": lambda: replayed(*args)}, a.rounds, cuda)
        row["compiled_bitwise_equal_to_eager"] = torch.equal(got, want) and torch.equal(got_replayed, want)
        rows.append(row)
        ops = row["op_host_us_no_grad"]
        print(f"{model:15s} T={tokens:4d}  op host us (no_grad) " + "  ".join(
            f"{n}: {ops[n + ' inference op']:5.1f} vs {ops[n + ' custom_op']:5.1f}" for n in calls)
              + "  module wall us " + "  ".join(f"{m} {v:6.1f}" for m, v in row["module_wall_us"].items())
              + "  " + "  ".join(f"{m} {v:6.1f}" for m, v in row["module_wall_us_reduce_overhead"].items())
              + ("" if row["compiled_bitwise_equal_to_eager"] else "  NOT EQUAL"), flush=True)
    results.write("sparse24-experts-compiled", {"rows": rows}, a.out, dtype="bf16", mode="default, reduce-overhead",
                  timing="one process; ways alternating by round; op host: 50 calls, the clock stopped when the "
                         "last returned; module wall: 20 calls waited for; medians of rounds")
    return 0 if all(r["compiled_bitwise_equal_to_eager"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
