"""``kernelplan bench llama``: a transformers Llama, dense against sparsified, in one run.

On a GPU the model has Llama-3-8B layer sizes and 2 decoder layers, in bf16;
on CPU a tiny configuration checks the path (its times support no claim).
Measured: prefill throughput at 2048 tokens, and greedy decode tokens/s at
batch 1 and 16 (32 new tokens after a 128-token prompt).  The sparsified
model's logits are checked against the masked-dense model (the same pruned
weights, dense) before anything is timed.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import kernelplan as kp


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


def _seconds(fn, dev, repeats: int) -> float:
    fn()  # warm-up: kernels compiled and 2:4 dispatch tuned outside the timing
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graphed_decode(dense, sparse, prompt, new: int, repeats: int) -> tuple[LlamaRow, float]:
    """Decode tokens/s with each step replayed as a CUDA graph (``decode.py``): the weights' cost, not the host's."""
    from .decode import DecodeStep, GraphedDecode

    batch, length = prompt.shape
    seconds, worst = [], 0.0
    for m in (dense, sparse):
        # Room for the prompt, the warm-up, the check and every timed step: positions never wrap.
        graphed = GraphedDecode(DecodeStep(m, prompt, length + 8 + new * repeats))
        err = graphed.check()
        worst = max(worst, err)
        seconds.append(graphed.seconds_per_step(new, repeats))
        print(f"decode batch {batch}, CUDA graph: replay vs eager step rel err {err:.1e}")
        del graphed
    return LlamaRow(f"decode batch {batch}, CUDA graph", batch / seconds[0], batch / seconds[1],
                    seconds[0] / seconds[1]), worst


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
    report = kp.sparsify(sparse, progress=False)
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
        repeats = 5 if gpu else 2
        prefill_len = 2048 if gpu else 128
        rows = []
        ids = torch.randint(0, vocab, (1, prefill_len), device=dev)
        t_dense, t_sparse = (_seconds(lambda m=m: m(ids), dev, repeats) for m in (dense, sparse))
        rows.append(LlamaRow(f"prefill {prefill_len} tokens", prefill_len / t_dense, prefill_len / t_sparse,
                             t_dense / t_sparse))
        for batch in (1, 16):
            prompt = torch.randint(0, vocab, (batch, 128 if gpu else 16), device=dev)
            new = 32 if gpu else 4

            def decode(m):
                return m.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

            t_dense, t_sparse = (_seconds(lambda m=m: decode(m), dev, repeats) for m in (dense, sparse))
            rows.append(LlamaRow(f"decode batch {batch}", batch * new / t_dense, batch * new / t_sparse,
                                 t_dense / t_sparse))
            if gpu:
                row, replay_err = _graphed_decode(dense, sparse, prompt, new, repeats)
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
