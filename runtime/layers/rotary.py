"""Rotary position embedding: inverse frequencies (with rope scaling) and per-batch cos/sin."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after ``default``, ``linear`` or ``llama3``
    scaling, or ``divisors`` (one per frequency: how a GGUF file stores Llama 3's scaling).
    Other rope types raise, naming the type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if kind == "divisors":
        divisors = torch.tensor(scaling["divisors"], dtype=torch.float32)
        if divisors.shape != inv_freq.shape:
            raise ValueError(f"rope divisors: {len(divisors)} given, {len(inv_freq)} needed")
        return inv_freq / divisors
    raise ValueError(
        f"rope_type {kind!r} is not supported (supported: default, linear, llama3, divisors)"
    )


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by ``factor``, short ones kept, and the
    band between is interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for a batch's positions once per forward; layers share them."""

    inv_freq: torch.Tensor  # [head_dim // 2] float32, a non-persistent buffer

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int. Returns cos, sin: [T, head_dim] float32 (rotate-half layout)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
