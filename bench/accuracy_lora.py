"""Winning back a 2:4 model's accuracy with LoRA (``kp.nn.lora``): the accuracy benchmark's trained byte-level Llama
(``kernelplan.bench.accuracy``), pruned by each method, then trained with LoRA adapters on every projection while its
2:4 weights stay frozen and run on the 2:4 kernels.

For each method: held-out perplexity after pruning, then after ``--steps`` AdamW steps of LoRA (rank ``--rank`` on
q, k, v, o, gate, up and down; batches of ``--batch`` random windows of the training split, a fixed seed). The dense
model gets the same adapters and steps, so the table separates what training on this text gives any model from what
the adapters win back for the 2:4 one. ``--variants masked`` trains ``kp.nn.lora(masked=True)`` too: the update cut to
each weight's 2:4 mask, merged into the 2:4 weights afterwards (the merged model's perplexity is reported). Weights
are bf16 on a GPU (adapters float32, PEFT's default) and float32 on the CPU.

    PYTHONPATH=src python bench/accuracy_lora.py [--steps 300] [--out bench/results/accuracy-lora-<gpu>.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

import kernelplan as kp
from kernelplan.bench import accuracy, environment

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_train(model, train: torch.Tensor, steps: int, rank: int, batch: int, lr: float, masked: bool = False,
               seed: int = 0):
    """The model wrapped in LoRA adapters (``kp.nn.lora`` where it holds 2:4 layers; ``masked``: the update cut to
    each weight's 2:4 mask) and trained ``steps`` steps."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=PROJECTIONS)
    adapted = peft.get_peft_model(model, kp.nn.lora(config, masked=masked))
    device = next(model.parameters()).device
    params = [p for p in adapted.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    g = torch.Generator().manual_seed(seed)
    adapted.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(train) - accuracy.SEQ, (batch,), generator=g).tolist()
        ids = torch.stack([train[s:s + accuracy.SEQ] for s in starts]).to(device)
        loss = adapted(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())
    adapted.eval()
    return adapted, sum(p.numel() for p in params), torch.stack(losses).float().cpu().tolist()


def held_bytes(model) -> dict:
    """Bytes the 2:4 layers hold (values and metadata, as held) and the trainable adapters hold."""
    sparse = sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, kp.nn.Sparse24Linear)
                 for t in (m.values, m.metadata))
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    return {"sparse_bytes": sparse, "adapter_bytes": adapters}


def run(dev: torch.device, steps: int, rank: int, batch: int, lr: float, held_out_tokens: int | None,
        variants=("plain",), on_row=None):
    """The table's rows; ``on_row(rows)`` after each (the bench writes them as they come: a run cut short keeps its
    rows)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    train, held = accuracy.corpus()
    if held_out_tokens is not None:
        held = held[:held_out_tokens]
    calib = accuracy.calibration(train)
    dense = accuracy.load_model(dev, dtype)
    rows = []
    for method in ("dense", "magnitude", "wanda", "sparsegpt"):
        pruned = copy.deepcopy(dense)
        if method != "dense":
            kp.sparsify(pruned, method=method, calibration=calib, progress=False)
        before = kp.evaluate(pruned, held, seq_len=accuracy.SEQ)
        for variant in variants if method != "dense" else ("plain",):
            model = copy.deepcopy(pruned)
            t0 = time.perf_counter()
            adapted, trained, losses = lora_train(model, train, steps, rank, batch, lr, masked=variant == "masked")
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            after = kp.evaluate(adapted, held, seq_len=accuracy.SEQ)
            row = dict(model=method, lora=variant, perplexity=before, after_lora=after, lora_parameters=trained,
                       sparse_layers=sum(isinstance(m, kp.nn.Sparse24Linear) for m in adapted.modules()),
                       train_seconds=seconds, first_loss=losses[0], last_loss=sum(losses[-10:]) / len(losses[-10:]),
                       **held_bytes(adapted))
            note = ""
            if variant == "masked":  # merged: plain 2:4 layers again, no adapters
                merged = adapted.merge_and_unload()
                row["after_merge"] = kp.evaluate(merged, held, seq_len=accuracy.SEQ)
                row["merged"] = held_bytes(merged)
                note = f", merged {row['after_merge']:.3f}"
            rows.append(row)
            _gaps(rows)
            if on_row is not None:
                on_row(rows)
            print(f"{method:<10} {variant:<7} perplexity {before:8.3f} -> {after:8.3f} after LoRA{note} ({trained} "
                  f"parameters, {row['sparse_layers']} 2:4 layers, {seconds:.1f} s)", flush=True)
    return rows


def _gaps(rows: list[dict]) -> None:
    dense_before, dense_after = rows[0]["perplexity"], rows[0]["after_lora"]
    for r in rows[1:]:
        r["gap_before"] = r["perplexity"] - dense_before  # over the dense model as it was
        r["gap_after"] = r["after_lora"] - dense_after  # over the dense model with the same training


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=None, help="the first N held-out bytes (default: all)")
    parser.add_argument("--variants", nargs="+", choices=("plain", "masked"), default=["plain"],
                        help="plain: PEFT's LoRA; masked: kp.nn.lora(masked=True), merged afterwards")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    env = environment(dev)  # at the start: the commit whose code runs, not one made while it ran
    gpu = "cpu" if dev.type == "cpu" else ("h200" if "H200" in env["device"] else "h100")
    out = args.out or f"bench/results/accuracy-lora-{gpu}.json"
    meta = {**env, "model": "kernelplan.bench.accuracy's byte-level Llama", "steps": args.steps, "rank": args.rank,
            "alpha": 2 * args.rank, "batch": args.batch, "seq": accuracy.SEQ, "lr": args.lr,
            "held_out_bytes": args.held_out or "whole split", "targets": PROJECTIONS,
            "calibration_windows": accuracy.CALIBRATION, "variants": args.variants}

    def write(rows: list[dict]) -> None:
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    torch.manual_seed(0)
    run(dev, args.steps, args.rank, args.batch, args.lr, args.held_out, args.variants, on_row=write)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
