"""Linear layers and embedding lookups on quantized block weights (kernels/quantized.py)."""

from __future__ import annotations

import torch

from kernels.dispatch import register
from kernels.quantized import QuantizedWeight


@register("quantized_linear", "torch")
def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x W^T (+ bias), x float32 [M, k], W the quantized [n, k] weight; float32 [M, n]."""
    y = x.float() @ weight.blocks.dequantize().t()
    return y if bias is None else y + bias


@register("quantized_rows", "torch")
def quantized_rows(index: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows ``index`` (int64 [T]) of the quantized weight, dequantized: float32 [T, k] (an
    embedding lookup)."""
    return weight.blocks.rows(index).dequantize()
