"""``torch.compile``, dense against ``kp.sparsify``'d, in one process: what a user who compiles a model gets.

Under ``torch.compile`` a 2:4 layer is one custom op in the compiled graph (``kernelplan::sparse24_linear``, or its
``_inference`` form where no gradient is needed), called through the dispatcher on every step; the eager fast
path's checks are traced away.  The calls run under ``torch.inference_mode`` or, with ``--context no_grad``, under
``torch.no_grad`` as Hugging Face's ``generate`` runs them.  Two parts, each timed in rounds that alternate the
variants (medians):

* **layer**: a ``--size`` x ``--size`` bf16 layer at n = 1 and ``--n``, calls back to back (host-bound where the
  kernels are short): ``nn.Linear`` and ``Sparse24Linear``, eager and ``torch.compile``'d (``--mode``), and the
  custom op called directly, in its autograd form and (where the tree has it) its inference form.  Per call: the
  wall time of back-to-back calls, waited for.
* **model**: ``bench/sparse24_model.py``'s decoder (``--model``, ``--layers``), dense and sparsified (head pruned
  too, siblings fused, as that bench), one decode step at each ``--batch``: eager and with ``model.forward``
  compiled (``--mode``, ``dynamic=False``; each batch compiles its own graph); with ``--unfused``, the same sparse
  model with ``fuse=False`` beside them.  Each compiled model's logits are
  checked against its eager step's first, and the custom ops one compiled sparse step calls are counted.  Then the
  bytes each model holds, the 2:4 layouts its calls built included.

Writes ``bench/results/sparse24-compiled-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_compiled.py
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import DecodeStep, weight_bytes
from kernelplan.timing import (by_short_name, host_us_per_call, interleaved, kernel_device_ms, profiled_calls,
                               wall_seconds)
from sparse24_model import ARCHITECTURES, DEFAULT, build_model


# What the calls run under: inference_mode, or no_grad as Hugging Face's generate() runs a step.
CONTEXTS = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def layer_part(size: int, ns: list[int], mode: str, rounds: int, context: str) -> list[dict]:
    dense = torch.nn.Linear(size, size, device="cuda", dtype=torch.bfloat16)
    sparse = kp.nn.Sparse24Linear.from_dense(dense)
    op = torch.ops.kernelplan.sparse24_linear
    compiled = {"nn.Linear": torch.compile(dense, mode=mode, dynamic=False),
                "Sparse24Linear": torch.compile(sparse, mode=mode, dynamic=False)}
    rows = []
    for n in ns:
        x = torch.randn(n, size, device="cuda", dtype=torch.bfloat16)
        variants = {"nn.Linear": lambda: dense(x), "Sparse24Linear": lambda: sparse(x),
                    "nn.Linear compiled": lambda: compiled["nn.Linear"](x),
                    "Sparse24Linear compiled": lambda: compiled["Sparse24Linear"](x),
                    "kernelplan::sparse24_linear": lambda: op(x, sparse.values, sparse.metadata, sparse.bias, "",
                                                              "compact")}
        if hasattr(torch.ops.kernelplan, "sparse24_linear_inference"):  # what a compiled graph needing no grad calls
            variants["kernelplan::sparse24_linear_inference"] = lambda: torch.ops.kernelplan.sparse24_linear_inference(
                x, sparse.values, sparse.metadata, sparse.bias, "", "compact")
        with CONTEXTS[context]():
            want = torch.nn.functional.linear(x.double(), sparse.to_dense().double(), sparse.bias.double())
            errs = {name: float((fn().double() - want).abs().max() / want.abs().max()) for name, fn in variants.items()
                    if "Sparse" in name or "::" in name}
            us = interleaved({name: lambda fn=fn: host_us_per_call(fn, x.device, 1000)
                              for name, fn in variants.items()}, rounds)
        rows.append({"part": "layer", "m": size, "k": size, "n": n, "us_per_call": us, "rel_err_vs_fp64": errs,
                     "compiled_speedup": us["nn.Linear compiled"] / us["Sparse24Linear compiled"],
                     "eager_speedup": us["nn.Linear"] / us["Sparse24Linear"]})
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    return rows


def device_split(fn) -> dict:
    """Device ms a call of ``fn`` spends in all its kernels, their count, and the eight longest by name (CUPTI)."""
    ms = kernel_device_ms(fn, 3)
    top = sorted(by_short_name(ms, 90).items(), key=lambda kv: -kv[1])[:8]
    return {"total_ms": sum(ms.values()), "kernels": len(ms), "top": {k: round(v, 4) for k, v in top}}


def op_calls(fn) -> dict:
    """kernelplan's custom ops called in one call of ``fn``, by name (torch.profiler's host events: under CUDA graphs
    the replays call none)."""
    prof = profiled_calls(fn, 1, cpu=True)
    return {ev.key: ev.count for ev in prof.key_averages() if ev.key.startswith("kernelplan::")}


def model_part(name: str, layers: int, batches: list[int], mode: str, rounds: int, profile: bool,
               context: str, unfused: bool = False) -> list[dict]:
    torch.manual_seed(0)
    # Every model's forward is one code object to dynamo, compiled once a model and batch: past its default limit of
    # 8 compiles, a third model (--unfused) at a third batch ran uncompiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(batches))
    with torch.device("cuda"):
        dense = build_model(name, layers).to(torch.bfloat16).eval()
    models = {"dense": dense, "sparse": copy.deepcopy(dense)}
    kp.sparsify(models["sparse"], progress=False, prune_output=True)  # the head too, as bench/sparse24_model.py
    if unfused:  # the same pruned weights, each layer its own GEMM (no sibling groups, no epilogue routes)
        models["sparse unfused"] = copy.deepcopy(dense)
        kp.sparsify(models["sparse unfused"], progress=False, prune_output=True, fuse=False)
    vocab = dense.config.vocab_size
    rows = []
    for batch in batches:
        prompt = torch.randint(0, vocab, (batch, 16), device="cuda")
        max_len = 16 + 8 * (rounds + 4) * 3
        with CONTEXTS[context]():
            steps = {f"{n} eager": DecodeStep(m, prompt, max_len) for n, m in models.items()}
        compiled, compile_s = {}, {}
        for n, m in models.items():
            c = copy.copy(m)  # the same modules and weights; its own forward attribute, compiled
            c.forward = torch.compile(m.forward, mode=mode, dynamic=False)
            with CONTEXTS[context]():
                compiled[f"{n} compiled"] = step = DecodeStep(m, prompt, max_len)  # the prefill eager: one compile
                step.model = c
                t0 = time.perf_counter()
                step()  # the decode graph's compile
                torch.cuda.synchronize()
                compile_s[n] = time.perf_counter() - t0
        errs = {}
        with CONTEXTS[context]():
            # One step from the same state, compiled and eager, for each model: inductor's own rounding (dense's)
            # beside the sparse model's, whose compiled graph runs the 2:4 kernels.
            for n in models:
                a, b = compiled[f"{n} compiled"], steps[f"{n} eager"]
                for t, s in zip(b.state(), a.state()):
                    t.copy_(s)
                got, want = a().float(), b().float()
                errs[n] = float((got - want).abs().max() / want.abs().max())
            steps |= compiled
            ms = interleaved({n: lambda s=s: wall_seconds(s) * 1e3 for n, s in steps.items()}, rounds, 3)
            split = {n: device_split(s) for n, s in steps.items()} if profile else None
            ops = {n: op_calls(steps[f"{n} compiled"]) for n in models if n != "dense"}
        rows.append({"part": "model", "case": f"decode batch {batch}", "ms": ms, "compile_s": compile_s,
                     "device_ms_by_kernel": split, "compiled_op_calls": ops,
                     "compiled_vs_eager_rel_err": errs,
                     "compiled_speedup": ms["dense compiled"] / ms["sparse compiled"],
                     "eager_speedup": ms["dense eager"] / ms["sparse eager"]})
        if unfused:
            rows[-1]["unfused_compiled_speedup"] = ms["dense compiled"] / ms["sparse unfused compiled"]
        print(rows[-1], flush=True)
        del steps, compiled
    # What each model holds, the 2:4 layouts its calls built included: compiled graphs read the same held weights.
    held = {"dense": weight_bytes(dense), "sparse": weight_bytes(models["sparse"])}
    rows.append({"part": "model", "case": "weight bytes", "bytes": held,
                 "sparse_over_dense": held["sparse"] / held["dense"]})
    print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT, choices=sorted(ARCHITECTURES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--n", type=int, default=64, help="the layer part's second n (its first is 1)")
    ap.add_argument("--mode", default="default", help="torch.compile's mode")
    ap.add_argument("--context", default="inference_mode", choices=sorted(CONTEXTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--unfused", action="store_true",
                    help="also the sparsified model without sibling groups and epilogue routes (fuse=False)")
    ap.add_argument("--skip", choices=("layer", "model"), default=None)
    ap.add_argument("--profile", action="store_true",
                    help="each model step's device time by kernel (CUPTI; under CUDA graphs it sees the replays only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    if a.skip != "layer":
        rows += layer_part(a.size, [1, a.n], a.mode, a.rounds, a.context)
    if a.skip != "model":
        rows += model_part(a.model, a.layers, a.batch, a.mode, a.rounds, a.profile, a.context, a.unfused)
    results.write("sparse24-compiled", {"rows": rows}, a.out, transformers=transformers.__version__, mode=a.mode,
                  architecture=a.model, layers=a.layers, context=a.context)
    return 0


if __name__ == "__main__":
    sys.exit(main())
