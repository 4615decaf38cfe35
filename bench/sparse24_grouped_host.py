"""Host work of an eager MoE experts call: the grouped launches bound (``GroupedBound``) against their parameters built
on every call (``grouped_linear`` before c779b0b, reproduced below with the same internals), in one process.

The same ``Sparse24Experts`` runs each way on the same inputs, the ways alternating round by round, for published
configs at a decode's token counts:

* host work alone: 20 eager calls, the clock stopped when the last returns (the GPU may still run);
* wall per call: 20 eager calls back to back, waited for (what an eager decode step pays where host-bound);
* each way's output against the other's, bit for bit (the same kernels with the same parameters).

Writes ``bench/results/sparse24-grouped-host-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_grouped_host.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from kernelplan.activations import GATED_EPILOGUES
from kernelplan.bench import results
from kernelplan.dtypes import dtype_info
from kernelplan.kernels import raw_stream, sparse24_grouped
from kernelplan.timing import host_us_per_call

from sparse24_experts import MODELS, sparse_calls


def unbound_grouped_linear(x, values, metadata, bias, offsets, experts, epilogue=None, scatter=None):
    """``grouped_linear`` as it was at 8f8165d: the launch looked up, its parameters built and packed, each call."""
    from kernelplan.kernels.sparse24 import sm_count

    g = sparse24_grouped
    s, k = x.shape
    m = values.shape[0] * 16 // experts
    gated = epilogue in GATED_EPILOGUES
    y = torch.empty(s, m // 2 if gated else m, dtype=x.dtype, device=x.device) if scatter is None else scatter[0]
    if s == 0:
        return y
    cfg = g.grouped_config(m, s, experts, gated)
    device = x.get_device()
    launch, maps = g._launcher(cfg, dtype_info(x.dtype).name, bias is not None, epilogue, scatter is not None, device)
    tiles = (-(-s // cfg.bn) + experts) * -(-m // cfg.rows)
    params = (maps.x(x.data_ptr(), s, k, x.stride(0)),
              *maps.w(values.data_ptr(), metadata.data_ptr(), experts * m, k, experts if gated else 1),
              0 if bias is None else bias.data_ptr(), y.data_ptr(), s, m, k, y.stride(0)) + (0,) * cfg.pp + \
        (offsets.data_ptr(), experts) + ((scatter[1].data_ptr(), scatter[2].data_ptr()) if scatter is not None else ())
    grid = min(sm_count(device), tiles) if cfg.pp else tiles
    launch((grid, 1, 1), params, raw_stream(device), packed=True)
    return y


WAYS = {"bound": sparse24_grouped.grouped_linear, "unbound": unbound_grouped_linear}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["Mixtral-8x7B", "Qwen3-30B-A3B", "OLMoE-1B-7B"],
                    choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="*", default=(1, 4, 16, 64))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    cuda = torch.device("cuda")
    for model, (count, hidden, _, k), tokens, call in sparse_calls(a.models, a.tokens):
        host, wall, outs = {w: [] for w in WAYS}, {w: [] for w in WAYS}, {}
        with torch.no_grad():
            for r in range(a.rounds):
                for way, fn in (list(WAYS.items()) if r % 2 == 0 else list(WAYS.items())[::-1]):
                    sparse24_grouped.grouped_linear = fn
                    outs.setdefault(way, call())
                    for _ in range(3):
                        call()
                    host[way].append(host_us_per_call(call, cuda, 20, wait=False))
                    wall[way].append(host_us_per_call(call, cuda, 20, wait=True))
        sparse24_grouped.grouped_linear = WAYS["bound"]
        row = {"model": model, "experts": count, "hidden": hidden, "top_k": k, "tokens": tokens,
               "host_us": {w: statistics.median(v) for w, v in host.items()},
               "wall_us": {w: statistics.median(v) for w, v in wall.items()},
               "bitwise_equal": torch.equal(outs["bound"], outs["unbound"])}
        rows.append(row)
        print(f"{model:15s} T={tokens:4d}  host us bound {row['host_us']['bound']:6.1f} unbound "
              f"{row['host_us']['unbound']:6.1f}  wall us bound {row['wall_us']['bound']:6.1f} unbound "
              f"{row['wall_us']['unbound']:6.1f}" + ("" if row["bitwise_equal"] else "  NOT EQUAL"), flush=True)
    results.write("sparse24-grouped-host", {"rows": rows}, a.out, dtype="bf16",
                  timing="one process; ways alternating by round; host: 20 eager calls, the clock stopped when the "
                         "last returned; wall: 20 eager calls waited for; medians of rounds")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
