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

    def layers(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        up = 2 * self.intermediate if self.gated else self.intermediate
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q), "gate_up": (up, self.hidden),
                "down": (self.hidden, self.intermediate)}


MODELS = (
    ModelConfig("Llama-3-8B", 4096, 14336, 32, 8, 128),  # Mistral-7B and each Mixtral-8x7B expert alike
    ModelConfig("Llama-3-70B", 8192, 28672, 64, 8, 128),
    ModelConfig("Qwen2.5-7B", 3584, 18944, 28, 4, 128),
    ModelConfig("Qwen2.5-14B", 5120, 13824, 40, 8, 128),
    ModelConfig("Qwen2.5-32B", 5120, 27648, 40, 8, 128),
    ModelConfig("Qwen2.5-72B", 8192, 29568, 64, 8, 128),
    ModelConfig("Gemma-2-9B", 3584, 14336, 16, 8, 256),
    ModelConfig("Gemma-2-27B", 4608, 36864, 32, 16, 128),
    ModelConfig("Phi-3-mini", 3072, 8192, 32, 32, 96),
    ModelConfig("Phi-3-medium", 5120, 17920, 40, 10, 128),
    ModelConfig("BERT-base/GPT-2", 768, 3072, 12, 12, 64, gated=False),
    ModelConfig("BERT-large", 1024, 4096, 16, 16, 64, gated=False),
)

BATCH_SIZES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def sweep_shapes() -> dict[tuple[int, int], list[str]]:
    """Every distinct (M, K) of the sweep set, with the model layers that have it."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in MODELS:
        for layer, shape in model.layers().items():
            shapes.setdefault(shape, []).append(f"{model.name} {layer}")
    return shapes
