"""``kernelplan bench accuracy``: perplexity of a small trained Llama, dense and pruned to 2:4 by each method.

The model (``data/tiny-llama``, trained by ``bench/train_tiny_lm.py``) reads
bytes (a 256-token vocabulary) and was trained on English documentation from
Debian's packages (``data/debian-docs.json.gz``, 20 MB, built by
``bench/build_doc_corpus.py``: the reStructuredText sources of the Python 3.11
documentation and Perl's POD manuals).  Every tenth document is held out; the
rest are trained on.  Perplexity here is per
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
CORPUS = DATA / "debian-docs.json.gz"
MODEL = DATA / "tiny-llama"
SEQ = 256
CALIBRATION = 64
HELD_OUT_EVERY = 10
# The trained model's architecture: byte-level, Llama blocks; in_features are multiples of 64, so every linear
# is held in the one device layout.
CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=True, rope_theta=10000.0)


def corpus(path: str | Path = CORPUS) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte streams ``(train, held_out)`` as int64 token ids, of ``path`` (a gzipped JSON of ``documents``)."""
    with gzip.open(path, "rb") as f:
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


def input_spread(model, ids: torch.Tensor) -> dict[str, float]:
    """Per linear layer that ``kp.sparsify`` would prune: max / median over input channels j of ||X_j||_2, its
    inputs' column norms on ``ids``.  Wanda's score |W_ij| ||X_j|| differs from magnitude's only as far as these
    norms differ: large trained models carry a few channels tens of times the median (LLM.int8's outlier
    features), where magnitude pruning then fails."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, inputs, _output):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
        return record

    handles = [mod.register_forward_hook(hook(name)) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and name != "lm_head"]
    try:
        with torch.no_grad():
            for i in range(0, len(ids), 16):
                model(ids[i:i + 16].to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    return {name: float(v.sqrt().max() / v.sqrt().median()) for name, v in sums.items()}


def fold_outliers(model, scale: float, share: float = 1 / 64, seed: int = 0) -> list[int]:
    """Give the model outlier features without changing its function: ``share`` of the hidden channels (the same in
    every layer, as a residual stream's outlier dimensions are) scaled by ``scale`` in each decoder layer's two
    RMSNorm gains, and the input columns of the projections they feed (q, k, v; gate, up) divided by it.  Exact in
    real arithmetic; the channels' inputs to those layers are ``scale`` times larger.  Returns the channels."""
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    channels = torch.randperm(hidden, generator=g)[:max(1, round(hidden * share))].tolist()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linears in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj)),
                                  (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
                norm.weight[channels] *= scale
                for lin in linears:
                    lin.weight[:, channels] /= scale
    return channels


def run(dev: torch.device, methods=("magnitude", "wanda", "sparsegpt"), held_out_tokens: int | None = None,
        model_dir: str | Path = MODEL, windows: int = CALIBRATION, outlier_scale: float | None = None,
        corpus_path: str | Path = CORPUS) -> list[dict]:
    """One row per model: dense, then each method; perplexity, its increase over dense, mean layer error, seconds.
    ``outlier_scale``: the model with ``fold_outliers(model, outlier_scale)`` applied first (the dense row says how
    spread its layers' inputs then are)."""
    import kernelplan as kp

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU matmuls in bf16 are slow, not more exact
    train, held = corpus(corpus_path)
    if held_out_tokens is not None:
        held = held[:held_out_tokens]
    calib = calibration(train, windows)
    dense = load_model(dev, dtype, model_dir)
    if outlier_scale is not None:
        fold_outliers(dense, outlier_scale)
    base = kp.evaluate(dense, held, seq_len=SEQ)
    spread = sorted(input_spread(dense, calib).values())
    rows = [dict(model="dense", perplexity=base, increase=0.0, mean_layer_error=0.0, seconds=0.0,
                 input_spread_median=spread[len(spread) // 2], input_spread_max=spread[-1],
                 outlier_scale=outlier_scale)]
    for method in methods:
        model = copy.deepcopy(dense)
        t0 = time.perf_counter()
        report = kp.sparsify(model, method=method, calibration=calib, report=True, progress=False)
        seconds = time.perf_counter() - t0
        ppl = kp.evaluate(model, held, seq_len=SEQ)
        rows.append(dict(model=method, perplexity=ppl, increase=ppl - base, seconds=seconds,
                         mean_layer_error=sum(report.errors.values()) / len(report.errors),
                         layers=len(report.converted), outlier_scale=outlier_scale))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<10} {'perplexity':>10} {'increase':>9} {'layer err':>9} {'prune s':>8}"]
    lines += [f"{r['model']:<10} {r['perplexity']:>10.3f} {r['increase']:>+9.3f} {r['mean_layer_error']:>9.4f} "
              f"{r['seconds']:>8.2f}" for r in rows]
    return "\n".join(lines)


# The study's scale: LLM.int8 (Dettmers et al. 2022) counts features of magnitude 6 and more as outliers, found in
# every layer of models past 6.7B parameters, up to about 20x the rest.
OUTLIER_SCALE = 16.0


def bench(dev: torch.device) -> tuple[list[dict], bool]:
    """``kernelplan bench accuracy``: on CPU the first 8192 held-out bytes (the whole split takes minutes there).
    Then the same model with ``fold_outliers(model, OUTLIER_SCALE)``: the same function, with outlier features."""
    held = None if dev.type == "cuda" else 8192
    rows = run(dev, held_out_tokens=held)
    folded = run(dev, held_out_tokens=held, outlier_scale=OUTLIER_SCALE)
    where = f"{'whole split' if dev.type == 'cuda' else 'first 8192 bytes'}, {CALIBRATION} calibration windows of " \
            f"{SEQ} bytes, on {dev}"
    for title, part in (("the trained model", rows),
                        (f"the same model with outlier features folded in ({OUTLIER_SCALE:g}x on 1/64 of the "
                         f"channels; same function)", folded)):
        print(f"{title}: held-out perplexity per byte, {where}; layers' input spread (max/median column norm) "
              f"median {part[0]['input_spread_median']:.1f}, max {part[0]['input_spread_max']:.1f}")
        print(table(part))
    rows += folded
    return rows, all(r["perplexity"] == r["perplexity"] and r["perplexity"] < float("inf") for r in rows)
