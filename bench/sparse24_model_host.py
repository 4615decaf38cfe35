"""Host work of an eager step, dense against ``kp.sparsify``'d, for one model of ``sparse24_model.ARCHITECTURES``.

Eager Hugging Face steps are host-bound (0053: 3.8-12.2 ms a step eagerly, 0.7-5.0 ms as a CUDA graph), so an
eager ratio reads the host.  This times the host work alone (the clock stops when the last call returns:
``timing.host_us_per_call(wait=False)``), the two models alternating in rounds, for decode steps and a prefill, and
then profiles each (cProfile) and prints the functions whose own time differs most between them: where a sparse
model's eager step spends host time that dense's does not.  Random weights, no download.  Writes
``bench/results/sparse24-model-host-<model>-<gpu>.json``.

    PYTHONPATH=src:bench KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_model_host.py \\
        --model gemma-2-9b

``--tiny`` shrinks the model to a few MB (a smoke test of the script; on the CPU, with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import DecodeStep
from kernelplan.timing import host_us_per_call, interleaved
from sparse24_model import ARCHITECTURES, DEFAULT, build_model

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=512, pad_token_id=0)


def own_ms(fn, calls: int) -> dict[str, float]:
    """Each function's own time (cProfile's tottime), ms a call of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return {f"{file.rsplit('/', 1)[-1]}:{line}:{name}": stat[2] / calls * 1e3
            for (file, line, name), stat in pstats.Stats(prof).stats.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT, choices=sorted(ARCHITECTURES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a few-MB model of the same family")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    with dev:
        dense = build_model(a.model, a.layers, **(TINY if a.tiny else {})).to(torch.bfloat16).eval()
    cfg = dense.config
    sparse = copy.deepcopy(dense)
    kp.sparsify(sparse, progress=False, prune_output=True)  # as bench/sparse24_model.py's "sparse": grouped
    models = {"dense": dense, "sparse": sparse}
    rows = []
    with torch.inference_mode():
        cases = {}
        for batch in (1, 128):
            prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device=dev)
            cases[f"decode batch {batch}"] = {n: DecodeStep(m, prompt, 16 + 40 * (a.rounds + 4)) for n, m in
                                              models.items()}
        ids = torch.randint(0, cfg.vocab_size, (1, 512), device=dev)
        cases["prefill 512"] = {n: (lambda m=m: m(ids, use_cache=False)) for n, m in models.items()}
        for case, fns in cases.items():
            host = interleaved({n: lambda fn=fn: host_us_per_call(fn, dev, 5, wait=False) / 1e3
                                for n, fn in fns.items()}, a.rounds)
            own = {n: own_ms(fn, 10) for n, fn in fns.items()}
            diff = sorted(((own["sparse"].get(k, 0) - own["dense"].get(k, 0), k)
                           for k in own["sparse"].keys() | own["dense"].keys()), reverse=True)
            row = {"case": case, "host_ms": host, "sparse_over_dense": host["sparse"] / host["dense"],
                   "own_ms_sparse_minus_dense_most": [(k, d) for d, k in diff[:12]],
                   "own_ms_sparse_minus_dense_least": [(k, d) for d, k in diff[-6:]]}
            rows.append(row)
            print(f"{case}: host ms a step, dense {host['dense']:.3f}, sparse {host['sparse']:.3f} "
                  f"({row['sparse_over_dense']:.3f}x)", flush=True)
            print("  most:", ", ".join(f"{k} {d:+.3f}" for k, d in row["own_ms_sparse_minus_dense_most"][:8]))
    if dev.type == "cuda":
        results.write(f"sparse24-model-host-{a.model}", {"rows": rows}, a.out, transformers=transformers.__version__,
                      architecture=a.model, layers=a.layers, tiny=a.tiny)
    return 0


if __name__ == "__main__":
    sys.exit(main())
