"""A vision tower, dense against ``kp.sparsify``'d, in one process (bf16): SigLIP-so400m's sizes by default.

SigLIP-so400m-patch14-384 (hidden 1152, MLP 4304, 16 heads, 27 layers, 729 patches an image) is the vision tower of
Gemma-3, PaliGemma 2, LLaVA-OneVision, Idefics3 and Moondream.  Its MLP's ``fc2`` has K = 4304, not a multiple of
64: kernelplan holds it padded to 4352 (docs/design/0083); before, it ran on the reference, which decompressed the
weight at every call.  Random weights, no download.  The sparsified tower's output is checked against the
masked-dense one first.  Then, alternating dense and sparse (medians of rounds), the forward at 1, 4 and 16 images,
replayed as a CUDA graph and run eagerly, and each model's weight bytes.  With ``--host``, the host work of the
forward at one image alone (``timing.host_us_per_call(wait=False)``) and the functions whose own time (cProfile)
differs most between the two models (``sparse24_model_host.own_ms``).  Writes
``bench/results/sparse24-vision-<gpu>.json`` (``--out``).

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_vision.py [--layers 27]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers

import kernelplan as kp
from kernelplan.bench import results
from kernelplan.bench.decode import Graphed, weight_bytes
from kernelplan.timing import interleaved, wall_seconds

# SigLIP-so400m-patch14-384's vision config (google/siglip-so400m-patch14-384, config.json).
SO400M = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=384, patch_size=14)


def host_work(models: dict, rounds: int) -> dict:
    """Host ms of one image's eager forward for each model, and the 12 functions the sparse one spends most more own
    time in."""
    from sparse24_model_host import own_ms

    from kernelplan.timing import host_us_per_call

    pixels = torch.randn(1, 3, 384, 384, device="cuda", dtype=torch.bfloat16)
    fns = {n: (lambda m=m: m(pixel_values=pixels)) for n, m in models.items()}
    host = interleaved({n: lambda fn=fn: host_us_per_call(fn, torch.device("cuda"), 5, wait=False) / 1e3
                        for n, fn in fns.items()}, rounds)
    own = {n: own_ms(fn, 10) for n, fn in fns.items()}
    diff = sorted(((own["sparse"].get(k, 0) - own["dense"].get(k, 0), k) for k in own["sparse"].keys() | own["dense"]),
                  reverse=True)
    row = {"host_ms": host, "own_ms_sparse_minus_dense_most": [(k, d) for d, k in diff[:12]]}
    print(f"host ms a forward (1 image): dense {host['dense']:.3f}, sparse {host['sparse']:.3f}", flush=True)
    print("  most:", ", ".join(f"{k} {d:+.3f}" for k, d in row["own_ms_sparse_minus_dense_most"]), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", default=None)
    ap.add_argument("--host", action="store_true", help="also the host work of one image's forward, and its profile")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(num_hidden_layers=a.layers, **SO400M)
    with torch.device("cuda"):
        dense = transformers.SiglipVisionModel(cfg).to(torch.bfloat16).eval()
    sparse = copy.deepcopy(dense)
    report = kp.sparsify(sparse, progress=False)
    masked = copy.deepcopy(dense)
    out = {"converted": len(report.converted), "padded": getattr(report, "padded", None),  # None: before 0083
           "summary": report.summary().splitlines()[:2]}
    print(*out["summary"], sep="\n", flush=True)
    rows = []
    with torch.inference_mode():
        for name in report.converted:
            masked.get_submodule(name).weight.copy_(sparse.get_submodule(name).to_dense())
        probe = torch.randn(2, 3, 384, 384, device="cuda", dtype=torch.bfloat16)
        got, want = (m(pixel_values=probe).last_hidden_state.float() for m in (sparse, masked))
        out["rel_err_vs_masked_dense"] = err = float((got - want).abs().max() / want.abs().max())
        print(f"output vs masked-dense rel err {err:.1e}", flush=True)
        del masked
        models = {"dense": dense, "sparse": sparse}
        for images in a.images:
            pixels = torch.randn(images, 3, 384, 384, device="cuda", dtype=torch.bfloat16)
            graphs = {n: Graphed(lambda m=m: m(pixel_values=pixels).last_hidden_state) for n, m in models.items()}
            check = max(g.check() for g in graphs.values())
            graph = interleaved({n: lambda g=g: g.replay_seconds(3) for n, g in graphs.items()}, a.rounds, 1)
            eager = interleaved({n: lambda m=m: wall_seconds(lambda: m(pixel_values=pixels))
                                 for n, m in models.items()}, a.rounds, 3)
            row = {"images": images, "tokens": images * (384 // 14) ** 2, "replay_vs_eager_rel_err": check}
            for mode, t in (("graph", graph), ("eager", eager)):
                row |= {f"{mode}_{n}_ms": s * 1e3 for n, s in t.items()}
                row[f"{mode}_speedup"] = t["dense"] / t["sparse"]
            rows.append(row)
            print(row, flush=True)
            del graphs
        if a.host:
            out["host"] = host_work(models, a.rounds)
    from kernelplan.sparse24.gemm import fast_path_backends

    out["backends"] = fast_path_backends()
    out["dense_weight_bytes"], out["sparse_weight_bytes"] = weight_bytes(dense), weight_bytes(sparse)
    out["sparse_over_dense_bytes"] = out["sparse_weight_bytes"] / out["dense_weight_bytes"]
    print(f"weights: dense {out['dense_weight_bytes'] / 2**20:.1f} MiB, "
          f"sparse {out['sparse_weight_bytes'] / 2**20:.1f} "
          f"MiB ({out['sparse_over_dense_bytes']:.3f}x)")
    results.write("sparse24-vision", {"rows": rows, **out}, a.out, transformers=transformers.__version__,
                  model="SigLIP-so400m-patch14-384 vision tower", layers=a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
