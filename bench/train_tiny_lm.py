"""Train the accuracy benchmark's model: a byte-level Llama on Debian's documentation text (kernelplan/bench/accuracy.py).

    PYTHONPATH=src python bench/train_tiny_lm.py OUT_DIR --steps 10000 --eval-every 500

On a GPU (bf16 autocast, AdamW, cosine schedule), windows of SEQ bytes drawn
at random from the training split; the held-out split is evaluated every
``--eval-every`` steps and the best model is kept.  The committed model took
10000 steps (164M bytes, 9 passes over the training split; 375 s on an H100);
its held-out perplexity was still falling.
Writes OUT_DIR/config.json and OUT_DIR/model.safetensors (bf16) via
save_pretrained, and OUT_DIR/train-log.json.  Reproduces
src/kernelplan/bench/data/tiny-llama up to GPU nondeterminism.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
import transformers

import kernelplan as kp
from kernelplan.bench.accuracy import CONFIG, CORPUS, SEQ, corpus


def train_lm(model, train: torch.Tensor, held: torch.Tensor, steps: int, batch: int, lr: float, eval_every: int,
             decay_1d: bool = True) -> tuple[tuple, list[dict]]:
    """AdamW with a warm-up and cosine schedule on random windows of ``train``, bf16 autocast on the model's device;
    held-out perplexity every ``eval_every`` steps.  ``((best perplexity, its state_dict, its step), log)``."""
    dev = next(model.parameters()).device
    params = list(model.parameters())
    groups = [dict(params=params, weight_decay=0.1)] if decay_1d else [
        dict(params=[q for q in params if q.dim() > 1], weight_decay=0.1),
        dict(params=[q for q in params if q.dim() <= 1], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 200) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    train_dev = train.to(dev)
    best, log, t0 = (float("inf"), None, 0), [], time.time()
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train) - SEQ - 1, (batch,), device=dev)
        ids = train_dev[starts[:, None] + torch.arange(SEQ, device=dev)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % eval_every == 0 or step == steps:
            ppl = kp.evaluate(model, held, seq_len=SEQ, batch_size=64)
            log.append(dict(step=step, train_loss=float(loss.detach()), held_out_perplexity=ppl, seconds=time.time() - t0))
            print(log[-1], flush=True)
            if ppl < best[0]:
                best = (ppl, copy.deepcopy(model.state_dict()), step)
    return best, log


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--decay-1d", type=int, default=1,
                   help="1: weight decay on every parameter (the committed model's recipe); 0: not on the 1-D ones "
                        "(the RMSNorm gains), as GPT-2/Llama recipes train")
    p.add_argument("--config", default="{}", help="JSON overrides of accuracy.CONFIG (hidden_size, ...)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--corpus", default=str(CORPUS), help="a gzipped JSON of documents (bench/build_doc_corpus.py)")
    p.add_argument("--init", default=None, help="a save_pretrained directory to train on from, not a random model")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    train, held = corpus(args.corpus)
    if args.init:
        model = transformers.LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(dev)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **json.loads(args.config)})).to(dev)
    best, log = train_lm(model, train, held, args.steps, args.batch, args.lr, args.eval_every, bool(args.decay_1d))
    model.load_state_dict(best[1])
    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "train-log.json"), "w") as f:
        json.dump(dict(best_step=best[2], best_perplexity=best[0], args=vars(args), torch=torch.__version__,
                       transformers=transformers.__version__, log=log), f, indent=1)
    print("best step", best[2], "held-out perplexity", best[0])


if __name__ == "__main__":
    main()
