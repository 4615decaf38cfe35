"""The sweep set: linear-layer shapes of public model configs, for benchmarks and dispatch rules.

Each model's (hidden, intermediate, attention heads, KV heads, head dim) is
taken from its published ``config.json``; its layers are the fused QKV
projection, the attention output, the fused gate+up projection (one GEMM of
2 x intermediate, as serving stacks run it) and the down projection.  A
shape is ``(out_features, in_features)`` = (M, K) of ``y = x @ W^T``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = True  # gate and up projections (SwiGLU/GeGLU); False: one up projection (BERT, GPT-2)
    vocabs: tuple[int, ...] = ()  # vocab_size of the models with these sizes: their LM heads are (vocab, hidden)

    def layers(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        up = 2 * self.intermediate if self.gated else self.intermediate
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q), "gate_up": (up, self.hidden),
                "down": (self.hidden, self.intermediate)}


MODELS = (
    # Mistral-7B and each Mixtral-8x7B expert have Llama-3-8B's sizes, and a vocabulary of 32000.
    ModelConfig("Llama-3-8B", 4096, 14336, 32, 8, 128, vocabs=(128256, 32000)),
    ModelConfig("Llama-3-70B", 8192, 28672, 64, 8, 128, vocabs=(128256,)),
    ModelConfig("Qwen2.5-7B", 3584, 18944, 28, 4, 128, vocabs=(152064,)),
    ModelConfig("Qwen2.5-14B", 5120, 13824, 40, 8, 128, vocabs=(152064,)),
    ModelConfig("Qwen2.5-32B", 5120, 27648, 40, 8, 128, vocabs=(152064,)),
    ModelConfig("Qwen2.5-72B", 8192, 29568, 64, 8, 128, vocabs=(152064,)),
    ModelConfig("Gemma-2-9B", 3584, 14336, 16, 8, 256, vocabs=(256000,)),
    ModelConfig("Gemma-2-27B", 4608, 36864, 32, 16, 128, vocabs=(256000,)),
    ModelConfig("Phi-3-mini", 3072, 8192, 32, 32, 96, vocabs=(32064,)),
    ModelConfig("Phi-3-medium", 5120, 17920, 40, 10, 128, vocabs=(32064,)),
    ModelConfig("BERT-base/GPT-2", 768, 3072, 12, 12, 64, gated=False, vocabs=(30522, 50257)),
    ModelConfig("BERT-large", 1024, 4096, 16, 16, 64, gated=False, vocabs=(30522,)),
)

# Public models outside MODELS, mostly smaller ones, whose projections fall between and below the sweep set's: held
# out of every rule's fit, to time a rule change on shapes it was not fitted on (docs/design/0057).  The sizes are
# their published config.json's.
HELD_OUT_MODELS = (
    ModelConfig("Qwen2.5-0.5B", 896, 4864, 14, 2, 64),
    ModelConfig("Qwen2.5-1.5B", 1536, 8960, 12, 2, 128),
    ModelConfig("Qwen2.5-3B", 2048, 11008, 16, 2, 128),
    ModelConfig("Llama-3.2-1B", 2048, 8192, 32, 8, 64),
    ModelConfig("Llama-3.2-3B", 3072, 8192, 24, 8, 128),
    ModelConfig("TinyLlama-1.1B", 2048, 5632, 32, 4, 64),
    ModelConfig("Gemma-2-2B", 2304, 9216, 8, 4, 256),
    ModelConfig("Phi-2", 2560, 10240, 32, 32, 80, gated=False),
    ModelConfig("GPT-2-XL", 1600, 6400, 25, 25, 64, gated=False),
    ModelConfig("Mistral-Nemo-12B", 5120, 14336, 32, 8, 128),
)

BATCH_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def lm_head_shapes() -> dict[tuple[int, int], list[str]]:
    """Every distinct (vocab, hidden) of the same models: their LM heads, which ``kp.sparsify`` prunes too.  Not in
    the sweep set, on which the kernels' rules were fitted: timed as shapes held out of it (docs/design/0052)."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in MODELS:
        for vocab in model.vocabs:
            shapes.setdefault((vocab, model.hidden), []).append(f"{model.name} lm_head")
    return shapes


def sweep_shapes() -> dict[tuple[int, int], list[str]]:
    """Every distinct (M, K) of the sweep set, with the model layers that have it."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in MODELS:
        for layer, shape in model.layers().items():
            shapes.setdefault(shape, []).append(f"{model.name} {layer}")
    return shapes


def held_out_shapes() -> dict[tuple[int, int], list[str]]:
    """Every distinct (M, K) of ``HELD_OUT_MODELS`` that is not in the sweep set, with the model layers that have
    it."""
    fitted = sweep_shapes()
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in HELD_OUT_MODELS:
        for layer, shape in model.layers().items():
            if shape not in fitted:
                shapes.setdefault(shape, []).append(f"{model.name} {layer}")
    return shapes
