"""MLPs with one activation on the 2:4 GEMM with the activation in its epilogue (``kp.nn.activated``), in bf16.

1. **The sweep set's up projections** (``intermediate x hidden`` of every model of ``kernelplan.bench.shapes.MODELS``,
   with bias), under GELU (erf: BERT's, GPT-NeoX's) and GELU (tanh: GPT-2's, Phi-2's), at each n, as CUDA graph
   replays (``triton.testing.do_bench_cudagraph``, median):
   * ``sparse_epilogue``: ``linear_parts`` with the activation as its epilogue, one kernel;
   * ``sparse_then_act``: the 2:4 GEMM, then ``F.gelu``: a sparsified MLP without the route;
   * ``dense``: ``F.gelu(F.linear(...))``, as the dense Hugging Face MLP runs it (the baseline).
2. **Models**, random weights, no download: BERT-base (12 layers) and a GPT-NeoX with Pythia-1.4B's sizes (4 of its
   24 layers).  Dense, ``kp.sparsify``'s model (routed) and the same with ``fuse=False`` (unrouted) alternate in one
   process (``kernelplan.timing.interleaved``, medians of rounds), each forward replayed as a CUDA graph and run
   eagerly.  Weight bytes of each model and the routes' call counts are reported.

Writes ``bench/results/sparse24-activated-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_activated.py
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import Graphed, weight_bytes
from kernelplan.bench.shapes import MODELS
from kernelplan.nn.activated import activated_mlp_of
from kernelplan.sparse24.format import prune_compress
from kernelplan.sparse24.gemm import linear_parts
from kernelplan.timing import graph_us, host_report, interleaved, wall_seconds
from sparse24_siblings_sweep import cli, summary  # bench/ is on the path, as the docstring's command runs it


ACTS = {"gelu": "none", "gelu_tanh": "tanh"}  # the epilogue's name: F.gelu's approximate=


def sweep(ns: list[int]) -> list[dict]:
    shapes: dict[tuple, list[str]] = {}
    for model in MODELS:
        shapes.setdefault((model.intermediate, model.hidden), []).append(model.name)
    rows = []
    for (m, k), names in shapes.items():
        w24 = prune_compress(torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5, packed=True)
        w, b = w24.decompress(), torch.randn(m, device="cuda", dtype=torch.bfloat16)  # dense: the same weights
        values, metadata = w24.values, w24.metadata
        for n, (act, approximate) in ((n, a) for n in ns for a in ACTS.items()):
            x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            got = linear_parts(x, values, metadata, b, act)
            want = F.gelu(x.float() @ w.float().T + b.float(), approximate=approximate)
            err = float((got.float() - want).abs().max() / want.abs().max())
            t = {"sparse_epilogue_us": graph_us(lambda: linear_parts(x, values, metadata, b, act)),
                 "sparse_then_act_us": graph_us(lambda: F.gelu(linear_parts(x, values, metadata, b),
                                                               approximate=approximate)),
                 "dense_us": graph_us(lambda: F.gelu(F.linear(x, w, b), approximate=approximate))}
            rows.append({"m": m, "k": k, "layers": names, "n": n, "act": act, "rel_err_vs_fp32": err, **t,
                         "speedup": t["dense_us"] / t["sparse_epilogue_us"],
                         "epilogue_gain": t["sparse_then_act_us"] / t["sparse_epilogue_us"],
                         "unrouted_speedup": t["dense_us"] / t["sparse_then_act_us"],
                         "dense_bytes": 2 * m * k, "sparse_bytes": values.nbytes + metadata.nbytes})
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    return rows


MODEL_CASES = {
    "BERT-base": (lambda: transformers.BertModel(transformers.BertConfig()), ((1, 128), (8, 128), (32, 128))),
    "GPT-NeoX, Pythia-1.4B sizes, 4 layers": (
        lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=16, vocab_size=50304)),
        ((1, 1), (1, 32), (1, 512))),
}


MLP_TYPES = ("BertIntermediate", "GPTNeoXMLP")  # the routed module of each model, its first found


def _out(model, ids):
    out = model(ids)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def models(rounds: int) -> list[dict]:
    rows = []
    for name, (build, cases) in MODEL_CASES.items():
        torch.manual_seed(0)
        dense = build().to("cuda", torch.bfloat16).eval()
        sparse, unrouted = copy.deepcopy(dense), copy.deepcopy(dense)
        kp.sparsify(sparse, progress=False)
        kp.sparsify(unrouted, progress=False, fuse=False)
        routes = [r for r in map(activated_mlp_of, sparse.modules()) if r is not None]
        trio = {"dense": dense, "sparse": sparse, "sparse unrouted": unrouted}
        for batch, seq in cases:
            ids = torch.randint(0, 1000, (batch, seq), device="cuda")
            with torch.inference_mode():
                want = _out(unrouted, ids).float()
                err = float((_out(sparse, ids).float() - want).abs().max() / want.abs().max())
                graphs = {n: Graphed(lambda m=m: _out(m, ids)) for n, m in trio.items()}
                graph = interleaved({n: lambda g=g: g.replay_seconds(5) for n, g in graphs.items()}, rounds)
                eager = interleaved({n: lambda m=m: wall_seconds(lambda: _out(m, ids)) for n, m in trio.items()},
                                    rounds, 3)
            row = {"model": name, "batch": batch, "seq": seq, "routed_vs_unrouted_rel_err": err}
            for mode, t in (("graph", graph), ("eager", eager)):
                row |= {f"{mode}_{n.replace(' ', '_')}_ms": s * 1e3 for n, s in t.items()}
                row[f"{mode}_speedup"] = t["dense"] / t["sparse"]
                row[f"{mode}_speedup_unrouted"] = t["dense"] / t["sparse unrouted"]
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            del graphs
        # One MLP's call alone, host work and back-to-back wall (kernelplan.timing.host_report), at the first case's
        # tokens: what the route's Python costs against the activation's launch it saves, eagerly.
        mlps = {n: next(mod for mod in m.modules() if type(mod).__name__ in MLP_TYPES) for n, m in trio.items()}
        k = next(c for c in mlps["dense"].children() if isinstance(c, torch.nn.Linear)).in_features
        x = torch.randn(*cases[0], k, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            host = host_report({n: lambda m=m: m(x) for n, m in mlps.items()}, x.device, calls=200, rounds=9)
        print(name, "one MLP's call, us:", {k: {n: round(v, 1) for n, v in t.items()} for k, t in host.items()},
              flush=True)
        rows.append({"model": name, "mlp_call_us": host, "mlp_call_tokens": list(cases[0]),
                     "weight_bytes": {n: weight_bytes(m) for n, m in trio.items()},
                     "routes": len(routes), "route_calls": {k: sum(r.stats[k] for r in routes) for k in ("fused", "own")},
                     "routes_off": sum(r.off is not None for r in routes)})
        print(rows[-1], flush=True)
        del dense, sparse, unrouted, trio
    return rows


def main() -> int:
    ns, out = cli()
    with torch.inference_mode():
        rows = sweep(ns)
    print("n: median [min, max] of: 2:4 with the epilogue over dense as HF runs it; the epilogue's gain over the 2:4 "
          "GEMM then F.gelu; 2:4 then F.gelu over dense")
    for act in ACTS:
        print(act)
        summary([r for r in rows if r["act"] == act], ("speedup", "epilogue_gain", "unrouted_speedup"))
    worst = max(r["rel_err_vs_fp32"] for r in rows)
    print(f"largest error against fp32: {worst:.2e}")
    model_rows = models(rounds=7)
    results.write("sparse24-activated", {"rows": rows, "models": model_rows}, out,
                  transformers=transformers.__version__)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
