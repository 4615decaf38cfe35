"""``kernelplan bench accuracy``: perplexity of a small trained Llama, dense and pruned to 2:4 by each method.

The model (``data/tiny-llama``, trained by ``bench/train_tiny_lm.py``) reads
bytes (a 256-token vocabulary) and was trained on English text that ships with
Python (``data/python-docs.json.gz``, built by ``bench/build_corpus.py``: the
help topics of ``pydoc_data`` and the standard library's docstrings).  Every
tenth document is held out; the rest are trained on.  Perplexity here is per
byte, on the held-out split.
Calibration takes ``CALIBRATION`` windows of ``SEQ`` bytes from the training split.
"""

from __future__ import annotations

import copy
import gzip
import json
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "python-docs.json.gz"
MODEL = DATA / "tiny-llama"
SEQ = 256
CALIBRATION = 64
HELD_OUT_EVERY = 10
# The trained model's architecture: byte-level, Llama blocks; in_features are multiples of 64, so every linear
# is held in the one device layout.
CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=True, rope_theta=10000.0)


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The byte streams ``(train, held_out)`` as int64 token ids."""
    with gzip.open(CORPUS, "rb") as f:
        docs = json.load(f)["documents"]
    splits = ["\n\n".join(d for i, d in enumerate(docs) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held)
              for held in (False, True)]
    return tuple(torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8).long() for s in splits)


def calibration(train: torch.Tensor, n: int = CALIBRATION, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    """``n`` windows of ``seq`` tokens at random offsets of the training split (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - seq, (n,), generator=g)
    return torch.stack([train[s:s + seq] for s in starts.tolist()])


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise SystemExit("kernelplan bench accuracy needs transformers: pip install transformers") from e
    return transformers


def load_model(device: torch.device | str, dtype: torch.dtype, model_dir: str | Path = MODEL):
    """The trained model (or another ``save_pretrained`` Llama directory) on ``device``, in ``dtype``, in eval mode."""
    transformers = _transformers()
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def run(dev: torch.device, methods=("magnitude", "wanda", "sparsegpt"), held_out_tokens: int | None = None,
        model_dir: str | Path = MODEL, windows: int = CALIBRATION) -> list[dict]:
    """One row per model: dense, then each method; perplexity, its increase over dense, mean layer error, seconds."""
    import kernelplan as kp

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU matmuls in bf16 are slow, not more exact
    train, held = corpus()
    if held_out_tokens is not None:
        held = held[:held_out_tokens]
    calib = calibration(train, windows)
    dense = load_model(dev, dtype, model_dir)
    base = kp.evaluate(dense, held, seq_len=SEQ)
    rows = [dict(model="dense", perplexity=base, increase=0.0, mean_layer_error=0.0, seconds=0.0)]
    for method in methods:
        model = copy.deepcopy(dense)
        t0 = time.perf_counter()
        report = kp.sparsify(model, method=method, calibration=calib, report=True, progress=False)
        seconds = time.perf_counter() - t0
        ppl = kp.evaluate(model, held, seq_len=SEQ)
        rows.append(dict(model=method, perplexity=ppl, increase=ppl - base, seconds=seconds,
                         mean_layer_error=sum(report.errors.values()) / len(report.errors),
                         layers=len(report.converted)))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<10} {'perplexity':>10} {'increase':>9} {'layer err':>9} {'prune s':>8}"]
    lines += [f"{r['model']:<10} {r['perplexity']:>10.3f} {r['increase']:>+9.3f} {r['mean_layer_error']:>9.4f} "
              f"{r['seconds']:>8.2f}" for r in rows]
    return "\n".join(lines)


def bench(dev: torch.device) -> tuple[list[dict], bool]:
    """``kernelplan bench accuracy``: on CPU the first 8192 held-out bytes (the whole split takes minutes there)."""
    rows = run(dev, held_out_tokens=None if dev.type == "cuda" else 8192)
    print(f"held-out perplexity per byte, {'whole split' if dev.type == 'cuda' else 'first 8192 bytes'}, "
          f"{CALIBRATION} calibration windows of {SEQ} bytes, on {dev}:")
    print(table(rows))
    return rows, all(r["perplexity"] == r["perplexity"] and r["perplexity"] < float("inf") for r in rows)
