"""Peak memory of `kernelplan sparsify IN.safetensors OUT.safetensors` on a multi-GB file: streamed against whole.

Writes a dense bf16 checkpoint of Llama-3-8B MLP-shaped layers (``--layers`` pairs of
14336x4096 and 4096x14336, random values), then runs, each in a new process:

* the command as it is (``kernelplan/stream.py``: a tensor at a time);
* the whole-file way it replaced: ``load_file``, ``sparsify_state_dict``, ``save_compressed``.

Each reports its peak resident memory (``ru_maxrss``; issue 28's target: <= 1.5 GB
on a 4 GB file), and its peak over what it held after its imports (Linux: the
peak, ``VmHWM``, is reset through ``/proc/self/clear_refs`` once imported).  Writes ``bench/results/sparsify-stream-cpu.json``.

    PYTHONPATH=src KERNELPLAN_COMMIT=$(git rev-parse --short HEAD) python bench/sparsify_stream_rss.py
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

import torch

from kernelplan.bench import environment

PROBE = textwrap.dedent("""
    import re, resource, sys
    import torch, safetensors, kernelplan.cli, kernelplan.stream, kernelplan.checkpoint, kernelplan.sparse24.format
    status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here, after the imports
    base = status("VmRSS")
    if sys.argv[1] == "stream":
        kernelplan.cli.main(["sparsify", sys.argv[2], sys.argv[3]])
    elif sys.argv[1] == "whole":
        from safetensors.torch import load_file
        from kernelplan.checkpoint import save_compressed, sparsify_state_dict
        save_compressed(sparsify_state_dict(load_file(sys.argv[2]))[0], sys.argv[3])
    print(status("VmHWM") - base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=18, help="pairs of 14336x4096 / 4096x14336 bf16 layers "
                    "(18: a 4.2 GB file)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "dense.safetensors")
        for i in range(a.layers):  # written a pair at a time, so that this process never holds the file either
            part = os.path.join(tmp, f"part{i}.safetensors")
            save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(14336, 4096).to(torch.bfloat16),
                       f"model.layers.{i}.mlp.down_proj.weight": torch.randn(4096, 14336).to(torch.bfloat16)}, part)
        # one file from the parts: the stream writer's own format code is not used to build its input
        parts = [os.path.join(tmp, f"part{i}.safetensors") for i in range(a.layers)]
        _concatenate(parts, src)
        size = os.path.getsize(src)
        out = {"file_bytes": size, "layers": 2 * a.layers}
        for mode in ("stream", "whole"):
            dst = os.path.join(tmp, f"{mode}.safetensors")
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", PROBE, mode, src, dst], capture_output=True, text=True,
                               check=True)
            out[f"{mode}_s"] = time.perf_counter() - t0
            over, peak = map(int, p.stdout.split()[-2:])
            out[f"{mode}_over_imports_bytes"], out[f"{mode}_peak_rss_bytes"] = over, peak
            print(f"{mode:>6}: peak RSS {peak / 2**30:.2f} GiB, {over / 2**30:.2f} GiB over the imports, "
                  f"{out[f'{mode}_s']:.0f} s", flush=True)
            if os.path.exists(dst):
                os.unlink(dst)
    print(f"file {size / 2**30:.2f} GiB: streamed peaks at {out['stream_peak_rss_bytes'] / 2**30:.2f} GiB, and holds {out['stream_over_imports_bytes'] / 2**30:.2f} GiB over the "
          f"imports, the whole-file way {out['whole_over_imports_bytes'] / 2**30:.2f} GiB")
    path = a.out or os.path.join(os.path.dirname(__file__), "results", "sparsify-stream-cpu.json")
    env = environment(torch.device("cpu"))
    with open(path, "w") as f:
        json.dump({**env, "cpu_count": os.cpu_count(), **out}, f, indent=1)
    print("wrote", path)
    return 0


def _concatenate(parts: list[str], dst: str) -> None:
    """safetensors files merged into one, a tensor at a time, with safetensors' own writer per part."""
    import struct

    headers, blobs = {}, []
    offset = 0
    for part in parts:
        with open(part, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = json.loads(f.read(n))
            head.pop("__metadata__", None)
            for name, entry in head.items():
                b, e = entry["data_offsets"]
                headers[name] = {**entry, "data_offsets": [offset + b, offset + e]}
            blobs.append((part, 8 + n, max(e for _, e in (v["data_offsets"] for v in head.values()))))
            offset += blobs[-1][2]
    text = json.dumps(headers).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for part, start, length in blobs:
            with open(part, "rb") as f:
                f.seek(start)
                while length:
                    chunk = f.read(min(length, 1 << 26))
                    out.write(chunk)
                    length -= len(chunk)
            os.unlink(part)


if __name__ == "__main__":
    sys.exit(main())
