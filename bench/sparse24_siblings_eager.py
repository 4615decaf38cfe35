"""Host time of an eager decode step of the Qwen2.5-7B-sized Llama (bench/sparse24_model.py), 2:4 grouped against
ungrouped, alternating rounds, and where a step's host time goes in each (cProfile, by function).

    PYTHONPATH=src:bench python bench/sparse24_siblings_eager.py
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import sys

import torch
import transformers

import kernelplan as kp
from kernelplan.bench.decode import DecodeStep
from kernelplan.nn import fuse_siblings
from kernelplan.timing import host_us_per_call, interleaved


def host_ms(step, calls: int = 5) -> float:
    """ms of host work per call: the clock stops when the last call returns."""
    return host_us_per_call(step, torch.device("cuda"), calls, wait=False) / 1e3


def main() -> int:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4,
                                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                   max_position_embeddings=4096)
    base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    kp.sparsify(base, progress=False, fuse=False)
    models = {"grouped": copy.deepcopy(base), "ungrouped": base}
    fuse_siblings(models["grouped"])
    with torch.inference_mode():
        for batch in (1, 32):
            prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device="cuda")
            steps = {n: DecodeStep(m, prompt, 16 + 400) for n, m in models.items()}
            for s in steps.values():
                for _ in range(3):
                    s()
            print(batch, {k: round(v, 3) for k, v in interleaved(
                {n: lambda s=s: host_ms(s) for n, s in steps.items()}, 25).items()}, "ms host per step")
            for name, s in steps.items():
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    s()
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
                print(name, batch, "\n".join(out.getvalue().splitlines()[4:26]))
        # A 512-token prefill, where every grouped layer runs alone (past GROUP_MAX_ROWS): wall per forward, and the
        # functions whose own time differs most between the two models.
        ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
        runs = {n: (lambda m=m: m(ids)) for n, m in models.items()}
        for fn in runs.values():
            for _ in range(3):
                fn()
        print("prefill 512", {k: round(v, 3) for k, v in interleaved(
            {n: lambda fn=fn: host_ms(fn) for n, fn in runs.items()}, 25).items()}, "ms wall per forward")
        own = {}
        for name, fn in runs.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            own[name] = {f"{k[0].rsplit('/', 1)[-1]}:{k[2]}": v[2] / 20 * 1e3 for k, v in pstats.Stats(prof).stats.items()}
        keys = set(own["grouped"]) | set(own["ungrouped"])
        diff = sorted(((own["grouped"].get(k, 0) - own["ungrouped"].get(k, 0), k) for k in keys), reverse=True)
        print("prefill own ms per forward, grouped - ungrouped, most:", [(k, round(d, 3)) for d, k in diff[:10]])
        print("least:", [(k, round(d, 3)) for d, k in diff[-5:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
