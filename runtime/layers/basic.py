"""Linear, embedding and RMSNorm modules whose parameters the weight loader fills in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels


class Linear(torch.nn.Module):
    """y = x W^T (+ b). ``out_features`` may stack several checkpoint tensors (q|k|v, gate|up),
    whose row ranges ``shard_offsets`` names for the loader."""

    def __init__(
        self, in_features: int, out_sizes: dict[str, int] | int, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        sizes = out_sizes if isinstance(out_sizes, dict) else {"": out_sizes}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = torch.nn.Parameter(torch.empty(offset, in_features, dtype=dtype), False)
        self.bias = torch.nn.Parameter(torch.empty(offset, dtype=dtype), False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(torch.nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(dim, dtype=dtype), False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
