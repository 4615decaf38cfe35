"""``kernelplan bench llama``: a transformers Llama, dense against sparsified, in one run.

On a GPU the model has Llama-3-8B layer sizes and 2 decoder layers, in bf16;
on CPU a tiny configuration checks the path (its times support no claim).
Measured: prefill throughput at 2048 tokens, and greedy decode tokens/s at
batch 1 and 16 (32 new tokens after a 128-token prompt), each eagerly and,
on a GPU, replayed as a CUDA graph (the kernels' cost alone: a Hugging Face
forward spends milliseconds of Python, which eager rows include).  The sparsified
model's logits are checked against the masked-dense model (the same pruned
weights, dense) before anything is timed.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch

import kernelplan as kp
from ..timing import interleaved


@dataclass
class LlamaRow:
    case: str
    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    speedup: float


def _config(transformers, gpu: bool):
    if gpu:
        return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                        max_position_embeddings=4096)
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)


def _wall(fn, dev) -> float:
    """Seconds of one call, the device drained before and after."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _row(case: str, tokens: int, seconds: dict[str, float]) -> LlamaRow:
    return LlamaRow(case, tokens / seconds["dense"], tokens / seconds["sparse"], seconds["dense"] / seconds["sparse"])


def _graphed_prefill(models: dict, ids: torch.Tensor, rounds: int) -> tuple[LlamaRow, float]:
    """Prefill replayed as a CUDA graph: the kernels' cost, without the ~4 ms of Python a Hugging Face forward takes."""
    from .decode import Graphed

    graphs = {name: Graphed(lambda m=m: m(ids).logits) for name, m in models.items()}
    worst = max(g.check() for g in graphs.values())
    print(f"prefill, CUDA graph: replay vs eager rel err {worst:.1e}")
    seconds = interleaved({name: lambda g=g: g.replay_seconds(3) for name, g in graphs.items()}, rounds, 1)
    return _row(f"prefill {ids.shape[1]} tokens, CUDA graph", ids.shape[1], seconds), worst


def _graphed_decode(models: dict, prompt: torch.Tensor, new: int, rounds: int) -> tuple[LlamaRow, float]:
    """Decode tokens/s with each step replayed as a CUDA graph (``decode.py``): the weights' cost, not the host's."""
    from .decode import DecodeStep, GraphedDecode

    batch, length = prompt.shape
    # Room for the prompt, the warm-up, the check and every timed step: positions never wrap.
    graphs = {name: GraphedDecode(DecodeStep(m, prompt, length + 8 + new * rounds)) for name, m in models.items()}
    worst = max(g.check() for g in graphs.values())
    print(f"decode batch {batch}, CUDA graph: replay vs eager step rel err {worst:.1e}")
    seconds = interleaved({name: lambda g=g: g.replay_seconds(new) for name, g in graphs.items()}, rounds, 1)
    return _row(f"decode batch {batch}, CUDA graph", batch, seconds), worst


def run(dev: torch.device) -> tuple[list[dict], bool]:
    try:
        import transformers
    except ImportError:
        print("kernelplan bench llama needs transformers: pip install transformers")
        return [{"error": "transformers is not installed"}], False
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(_config(transformers, gpu)).to(dev, dtype).eval()
    sparse = copy.deepcopy(dense)
    # The LM head pruned too, as every earlier result of this bench measured it (sparsify keeps it dense by default).
    report = kp.sparsify(sparse, progress=False, prune_output=True)
    masked = copy.deepcopy(dense)
    vocab = dense.config.vocab_size
    with torch.inference_mode():
        for name in report.converted:
            masked.get_submodule(name).weight.copy_(sparse.get_submodule(name).to_dense())
        probe = torch.randint(0, vocab, (2, 64), device=dev)
        got, want = sparse(probe).logits.float(), masked(probe).logits.float()
        err = float((got - want).abs().max() / want.abs().max())
        del masked
        ok = err <= (2e-2 if gpu else 1e-5)
        print(f"\nllama ({report.summary().splitlines()[0]}); logits vs masked-dense: rel err {err:.1e} "
              f"{'ok' if ok else 'NO'}")
        rounds = 7 if gpu else 2
        prefill_len = 2048 if gpu else 128
        models = {"dense": dense, "sparse": sparse}
        ids = torch.randint(0, vocab, (1, prefill_len), device=dev)
        for m in models.values():
            m(ids)  # warm-up: kernels compiled and 2:4 dispatch tuned outside the timing
        seconds = interleaved({name: lambda m=m: _wall(lambda: m(ids), dev) for name, m in models.items()},
                               rounds, 3)
        rows = [_row(f"prefill {prefill_len} tokens", prefill_len, seconds)]
        if gpu:
            row, replay_err = _graphed_prefill(models, ids, rounds)
            rows.append(row)
            ok = ok and replay_err <= 2e-2
        for batch in (1, 16):
            prompt = torch.randint(0, vocab, (batch, 128 if gpu else 16), device=dev)
            new = 32 if gpu else 4

            def decode(m):
                return m.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

            for m in models.values():
                decode(m)
            seconds = interleaved({name: lambda m=m: _wall(lambda: decode(m), dev) for name, m in models.items()},
                                   rounds if gpu else 1, 1)
            rows.append(_row(f"decode batch {batch}", batch * new, seconds))
            if gpu:
                row, replay_err = _graphed_decode(models, prompt, new, rounds)
                rows.append(row)
                # A capture may run other 2:4 backends than the eager step (GemmSparse24Descriptor.graph):
                # the bar is the logits check's, not bitwise equality.
                ok = ok and replay_err <= 2e-2
    from ..sparse24.gemm import fast_path_backends

    backends = fast_path_backends()  # what the sparsified model's layers ran, per problem
    print("2:4 backends: " + ", ".join(f"{b['m']}x{b['k']} n={b['n']}{' graph' if b['graph'] else ''} {b['backend']}"
                                       for b in backends))
    for r in rows:
        print(f"{r.case:24} dense {r.dense_tokens_per_s:10.1f} tok/s  sparse {r.sparse_tokens_per_s:10.1f} tok/s  "
              f"{r.speedup:5.2f}x")
    if not gpu:
        print("CPU: a tiny model to check the path; speed claims come from GPU runs only")
    return [{"logits_rel_err": err, "converted": len(report.converted), "skipped": report.skipped,
             "sparse24_backends": backends}] + \
        [asdict(r) for r in rows], ok
