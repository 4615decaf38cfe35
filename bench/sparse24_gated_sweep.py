"""A gated MLP's gate/up over the sweep set: one 2:4 GEMM with the gated epilogue against the ways it runs without.

For every gated model of ``kernelplan.bench.shapes.MODELS`` (gate and up of ``intermediate`` rows each, K = hidden)
and each n, timed as CUDA graph replays (``triton.testing.do_bench_cudagraph``, median), bf16, SwiGLU:
* ``sparse_gated``: ``linear_parts`` with the gated epilogue (``kp.sparse24.gated_linear``): one kernel;
* ``sparse_grouped_act``: the grouped 2:4 GEMM, then ``kp.gated_activation`` (two kernels);
* ``sparse_separate``: two 2:4 GEMMs, then ``silu(g) * u`` in torch, as a sparsified HF MLP ran without groups;
* ``dense_separate``: the same with ``F.linear``, as the dense HF model runs it (the baseline);
* ``dense_grouped_act``: one ``F.linear`` on both weights, then ``kp.gated_activation``: dense's best here.
Bytes held are those of the weights (2:4: the one layout, 0.5625x).  Writes
``bench/results/sparse24-gated-sweep-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_gated_sweep.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.timing import graph_us
from sparse24_siblings_sweep import cli, summary  # bench/ is on the path, as the docstring's command runs it
from kernelplan.bench.shapes import MODELS
from kernelplan.sparse24.format import prune_compress
from kernelplan.sparse24.gemm import linear_parts



def main() -> int:
    ns, out = cli()
    shapes: dict[tuple, list[str]] = {}
    for model in MODELS:
        if model.gated:
            shapes.setdefault((model.hidden, model.intermediate), []).append(model.name)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for (k, h), names in shapes.items():
            gate, up = (torch.randn(h, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(2))
            sg, su = prune_compress(gate).packed(), prune_compress(up).packed()
            gate, up = sg.decompress(), su.decompress()  # dense runs the same (pruned) weights
            both = torch.cat([gate, up])
            values, metadata = torch.cat([sg.values, su.values]), torch.cat([sg.metadata, su.metadata])
            for n in ns:
                x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                got = linear_parts(x, values, metadata, None, "gated_silu_first")
                want = F.silu(x.float() @ gate.float().T) * (x.float() @ up.float().T)
                err = float((got.float() - want).abs().max() / want.abs().max())
                t = {"sparse_gated_us": graph_us(lambda: linear_parts(x, values, metadata, None, "gated_silu_first")),
                     "sparse_grouped_act_us": graph_us(lambda: kp.gated_activation(linear_parts(x, values, metadata),
                                                                                "swiglu", gate="first")),
                     "sparse_separate_us": graph_us(lambda: F.silu(linear_parts(x, sg.values, sg.metadata)) *
                                                 linear_parts(x, su.values, su.metadata)),
                     "dense_separate_us": graph_us(lambda: F.silu(F.linear(x, gate)) * F.linear(x, up)),
                     "dense_grouped_act_us": graph_us(lambda: kp.gated_activation(F.linear(x, both), "swiglu",
                                                                               gate="first"))}
                rows.append({"k": k, "h": h, "layers": names, "n": n, "rel_err_vs_fp32": err, **t,
                             "speedup": t["dense_separate_us"] / t["sparse_gated_us"],
                             "speedup_vs_dense_grouped_act": t["dense_grouped_act_us"] / t["sparse_gated_us"],
                             "epilogue_gain": t["sparse_grouped_act_us"] / t["sparse_gated_us"],
                             "gain_over_separate": t["sparse_separate_us"] / t["sparse_gated_us"],
                             "dense_bytes": 2 * both.numel(), "sparse_bytes": values.numel() * 2 + metadata.numel() * 4})
                print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    print("n: median [min, max] of: 2:4 gated over dense as HF runs it; over dense grouped + gated kernel; "
          "the epilogue's gain over 2:4 grouped + gated kernel; over 2:4 separate + torch")
    summary(rows, ("speedup", "speedup_vs_dense_grouped_act", "epilogue_gain", "gain_over_separate"))
    worst = max(r["rel_err_vs_fp32"] for r in rows)
    print(f"largest error against fp32: {worst:.2e}")
    results.write("sparse24-gated-sweep", {"rows": rows}, out)
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
