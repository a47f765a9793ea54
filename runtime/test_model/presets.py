"""Model shapes the test-model builder knows, and how each architecture dresses them."""

from __future__ import annotations

from dataclasses import dataclass, replace

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Preset:
    """The shape of a decoder-only model; ``head_dim`` None means hidden_size // num_heads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    dtype: str = "float32"

    def for_arch(self, arch: str) -> Preset:
        """Qwen3 models use a head_dim decoupled from hidden_size // num_heads; so do we."""
        if arch == "qwen3" and self.head_dim is None:
            return replace(self, head_dim=(self.hidden_size // self.num_heads) * 3 // 2)
        return self


PRESETS: dict[str, Preset] = {
    # Preset(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size, ...)
    # A few M parameters: builds in about a second, for tests.
    "tiny": Preset(128, 3, 4, 2, 352, 4096, max_position_embeddings=8192),
    # ~26M parameters, vocab 8k: for benchmarks on CPU.
    "small": Preset(512, 6, 8, 4, 1408, 8192),
    # The real Qwen2.5-0.5B shape (494M parameters with the real 151,936-entry vocabulary).
    "qwen2.5-0.5b-shape": Preset(896, 24, 14, 2, 4864, 151936, dtype="bfloat16"),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
