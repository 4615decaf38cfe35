"""A transformers Llama, sparsified: logits match the masked-dense model and generate() runs.

Skipped where transformers is not installed; the test extra installs it.
"""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp

try:
    import transformers
except ImportError:
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@needs_transformers
def test_sparsified_llama_matches_masked_dense_and_generates(seed):
    model = _tiny_llama()
    dense = _tiny_llama()
    dense.load_state_dict(model.state_dict())
    report = kp.sparsify(model, progress=False)
    # q/k/v/o, gate/up/down in 2 layers; the LM head stays dense by default (prune_output=False).
    assert len(report.converted) == 2 * 7 and list(report.skipped) == ["model.embed_tokens", "lm_head"]
    with torch.no_grad():
        for name in report.converted:
            dense.get_submodule(name).weight.copy_(model.get_submodule(name).to_dense())
        ids = torch.randint(0, 128, (2, 12))
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
        out = model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)
    assert torch.equal(out, dense.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0))


@needs_transformers
def test_bench_llama_runs_on_cpu():
    from kernelplan.bench import llama

    rows, ok = llama.run(torch.device("cpu"))
    assert ok and rows[0]["logits_rel_err"] <= 1e-5 and rows[0]["converted"] == 15
    assert [r["case"] for r in rows[1:]] == ["prefill 128 tokens", "decode batch 1", "decode batch 16"]
    assert all(r["dense_tokens_per_s"] > 0 and r["sparse_tokens_per_s"] > 0 for r in rows[1:])


def test_benchmarks_time_in_alternating_rounds_with_the_collector_paused():
    import gc

    from kernelplan.timing import interleaved

    order, collecting = [], []
    samples = {"dense": iter([3.0, 1.0, 2.0, 9.0]), "sparse": iter([1.0, 5.0, 2.0, 2.0])}

    def sampler(name):
        def sample():
            order.append(name)
            collecting.append(gc.isenabled())
            return next(samples[name])
        return sample

    was = gc.isenabled()
    out = interleaved({name: sampler(name) for name in samples}, rounds=2, per_round=2)
    assert order == ["dense", "dense", "sparse", "sparse", "sparse", "sparse", "dense", "dense"]  # rotated
    assert out == {"dense": 2.5, "sparse": 2.0}  # medians of all four samples each
    assert not any(collecting) and gc.isenabled() == was

    def failing():
        raise RuntimeError("a sampler failed")

    with pytest.raises(RuntimeError, match="a sampler failed"):
        interleaved({"dense": failing}, rounds=1, per_round=1)
    assert gc.isenabled() == was  # restored on the way out


@pytest.mark.skipif(transformers is not None, reason="checks the message shown where transformers is missing")
def test_bench_llama_says_what_is_missing():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kernelplan", "bench", "llama"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "needs transformers: pip install transformers" in out.stdout


@needs_transformers
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_on_a_static_cache_is_greedy_generate(seed, batch):
    """The step ``kernelplan bench llama`` captures in a CUDA graph decodes what generate() does."""
    from kernelplan.bench.decode import DecodeStep

    model = _tiny_llama()
    kp.sparsify(model, progress=False)
    prompt = torch.randint(0, 128, (batch, 7))
    with torch.inference_mode():
        want = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[:, 7:]
        step = DecodeStep(model, prompt, max_len=16)
        got = [step.tok.clone()]
        for _ in range(5):
            step()
            got.append(step.tok.clone())
        # The state it lists is what a graph replay reads and writes: the token, the position, the cache.
        state = {id(t) for t in step.state()}
        assert id(step.tok) in state and id(step.pos) in state and len(state) > 2
    assert int(step.pos) == 7 + 5
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=0)


@needs_transformers
def test_decode_step_lists_the_cache_s_python_counters(seed):
    """Llama-4's chunked-attention layers count their tokens in a Python int: a graph's capture advances it without
    running the step, so ``GraphedDecode`` sets it back (``counters``), as it does in ``check``."""
    from kernelplan.bench.decode import DecodeStep
    from test_experts_every_token import _llama4_model

    model = _llama4_model(torch.float32)
    with torch.inference_mode():
        step = DecodeStep(model, torch.randint(0, 128, (1, 7)), max_len=16)
        for _ in range(3):
            step()
    counters = step.counters()
    assert counters and all(type(layer).__name__ == "StaticSlidingWindowLayer" for layer, _, _ in counters)
    assert {(name, value) for _, name, value in counters} == {("cumulative_length_int", int(step.pos))}


@pytest.mark.gpu
@needs_transformers
def test_a_graphed_decode_step_replays_the_eager_step_with_a_sliding_window_cache(seed):
    """A sparsified Llama-4 (chunked-attention layers keep a Python counter) and a Llama: the replay from a state
    equals the eager step from it, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernelplan.bench.decode import DecodeStep, GraphedDecode
    from test_experts_every_token import _llama4_model

    for model in (_llama4_model(torch.bfloat16).cuda(), _tiny_llama().to(torch.bfloat16).cuda()):
        kp.sparsify(model, progress=False)
        with torch.inference_mode():
            graph = GraphedDecode(DecodeStep(model, torch.randint(0, 128, (1, 7), device="cuda"), max_len=32))
            assert graph.check() == 0.0
