"""Peak memory of ``kp.evaluate`` on the CPU: SmolLM2-135M-Instruct (``bench/accuracy_smollm.py``'s model, vocabulary
49152), 8 held-out windows of 2048 tokens, float32.  The process's peak RSS (``ru_maxrss``) before and after the call
and the perplexity; run it at two commits to compare implementations (docs/design/0023).

    PYTHONPATH=src python bench/evaluate_memory.py
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

import kernelplan as kp
from accuracy_smollm import documents, load, windows
from kernelplan.bench import environment

WINDOWS, SEQ = 8, 2048


def main() -> int:
    model, tokenizer = load()
    _, held = documents()
    ids = windows(tokenizer, held, 64, seed=1).reshape(-1)[: WINDOWS * SEQ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    ppl = kp.evaluate(model, ids, seq_len=SEQ)
    row = {"perplexity": ppl, "seconds": time.perf_counter() - start, "peak_rss_before": before,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "windows": WINDOWS, "seq": SEQ}
    print(json.dumps(row))
    env = environment(torch.device("cpu"))
    env["device"] = f"cpu ({os.cpu_count()} CPUs)"
    path = os.path.join(os.path.dirname(__file__), "results", "evaluate-memory-cpu.json")
    with open(path, "w") as f:
        json.dump({"meta": env, "rows": [row]}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
