"""Linear, embedding and RMSNorm modules whose parameters the weight loader fills in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels


def onednn_packing_available(weight: torch.Tensor) -> bool:
    """Whether ``pack_weight`` applies: float32 on CPU with oneDNN (mkldnn) in this torch."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered into oneDNN's blocked layout for ``packed_linear``.

    Measured on the 2-core VMs: 2.5-3x faster than ``F.linear`` (MKL) at 32-2048 rows and up
    to 6x for a wide output at one row (docs/kernels.md); results differ by float32 rounding.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(torch.nn.Module):
    """y = x W^T (+ b). ``out_features`` may stack several checkpoint tensors (q|k|v, gate|up),
    whose row ranges ``shard_offsets`` names for the loader. After ``pack()`` (CPU, float32)
    the weight lives only in oneDNN's layout and ``weight`` is an empty placeholder."""

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
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Move the (loaded) weight into oneDNN's layout, when that applies; frees the plain copy
        so the weights are not held twice."""
        if self.packed is None and onednn_packing_available(self.weight):
            self.packed = pack_weight(self.weight)
            self.weight = torch.nn.Parameter(self.weight.new_empty(0), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
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
