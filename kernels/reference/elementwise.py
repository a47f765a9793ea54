"""Norms, rotary embedding and gated activation, numerically as Hugging Face models do them.

Plain tensor ops without host syncs, so they are registered graph-safe (CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from arbor_kernels.dispatch import register


@register("rms_norm", "torch", graph_safe=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back to x's dtype before scaling."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@register("fused_add_rms_norm", "torch", graph_safe=True)
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


@register("apply_rotary_emb", "torch", graph_safe=True)
def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by cos/sin [T, D] (rotate-half layout, float32)."""
    cos = cos.unsqueeze(1).to(q.dtype)  # [T, 1, D]
    sin = sin.unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@register("silu_and_mul", "torch", graph_safe=True)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up; returns silu(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
