"""How long a new process waits for its first 2:4 call, with the kernel and plan caches cold and warm; and warmup.

* first call, cold: a new process, an empty ``KERNELPLAN_CACHE_DIR``, one
  3584x3584 bf16 ``Sparse24Linear`` at n = 32 (the call alone, not the imports);
* first call, warm: a second new process on the same cache folder;
* ``kernelplan warmup`` of a Llama-3-8B-shaped layer set (4096x4096, 1024x4096,
  14336x4096, 4096x14336), batch sizes 1, 16, 128, 2048, with a cold cache:
  its wall time and the NVRTC compiles it made, then the compiles a second
  process makes calling those shapes after it (0 is the target).

Writes ``bench/results/sparse24-first-call-<gpu>.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparse24_first_call.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from kernelplan.bench import results

FIRST_CALL = textwrap.dedent("""
    import time, torch, kernelplan as kp
    from kernelplan.kernels import nvrtc
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(3584, 3584, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(32, 3584, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        layer(x)
    torch.cuda.synchronize()
    print(time.perf_counter() - t0, nvrtc.COMPILES[0])
""")

AFTER_WARMUP = textwrap.dedent("""
    import torch, kernelplan as kp
    from kernelplan.kernels import nvrtc
    shapes = {shapes}
    with torch.inference_mode():
        for m, k in shapes:
            layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, bias=False, device="cuda", dtype=torch.bfloat16))
            for n in (1, 16, 128, 2048):
                layer(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    print(nvrtc.COMPILES[0])
""")

LLAMA_8B = [[4096, 4096], [1024, 4096], [14336, 4096], [4096, 14336]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KERNELPLAN_CACHE_DIR": cache}
        for case in ("cold", "warm"):
            p = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, check=True)
            seconds, compiles = p.stdout.split()
            out[f"first_call_{case}_s"], out[f"first_call_{case}_compiles"] = float(seconds), int(compiles)
            print(f"first call, caches {case}: {float(seconds):.3f} s, {compiles} NVRTC compiles", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KERNELPLAN_CACHE_DIR": cache}
        shapes = os.path.join(cache, "shapes.json")
        with open(shapes, "w") as f:
            json.dump(LLAMA_8B, f)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "kernelplan", "warmup", "--shapes", shapes], env=env,
                           capture_output=True, text=True, check=True)
        out["warmup_llama3_8b_s"] = time.perf_counter() - t0
        out["warmup_table"] = p.stdout
        after = subprocess.run([sys.executable, "-c", AFTER_WARMUP.format(shapes=LLAMA_8B)], env=env,
                               capture_output=True, text=True, check=True)
        out["compiles_after_warmup"] = int(after.stdout.split()[-1])
        print(p.stdout)
        print(f"warmup (Llama-3-8B shapes, 4 batch sizes, cold): {out['warmup_llama3_8b_s']:.1f} s in all; "
              f"a later process calling those shapes compiled {out['compiles_after_warmup']} kernels", flush=True)
    results.write("sparse24-first-call", out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
