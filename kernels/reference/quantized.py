"""Linear layers and embedding lookups on quantized block weights (kernels/quantized.py).

``quantized_linear`` computes what the native kernels compute, exactly but for float32
rounding: the activations are quantized per block of the weight's block size, as llama.cpp
quantizes them for its integer dot products (``quantize_activations``), each block's integer
dot product is exact (float64 holds it), and the per-block sums are taken in float64.
``quantized_linear_float`` is the float product with the dequantized weight; the two differ by
the activation rounding alone, bounded by ``activation_error_bound``.
"""

from __future__ import annotations

import torch

from kernels.dispatch import register
from kernels.quantized import QuantizedWeight


def quantize_activations(
    x: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float [M, k] per block of ``block`` values: int8 codes [M, k], each block's scale
    ``max|x| / 127`` (float32 [M, k // block]) and the sum of its codes (int32 [M, k // block]).
    A code is ``round(x * (127 / max|x|))``, rounded half to even, in float32; an all-zero
    block has scale 0 and codes 0."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=-1)
    # A true division (``127.0 / amax`` would multiply by a rounded reciprocal), as in C++.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0.0)
    codes = torch.round(xb * inverse.unsqueeze(-1)).to(torch.int8)
    scale = amax.div(torch.full_like(amax, 127.0))
    return codes.view(m, k), scale, codes.sum(dim=-1, dtype=torch.int32)


@register("quantized_linear", "torch")
def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x W^T (+ bias), x float32 [M, k], W the quantized [n, k] weight; float32 [M, n].
    The activations are quantized per block (``quantize_activations``): for each block,
    ``y += xscale * (scale * dot(q, xq) + offset * sum(xq))``."""
    blocks = weight.unpack()
    lead = x.shape[:-1]
    codes, xscale, xsum = quantize_activations(x.reshape(-1, weight.k), weight.block)
    m, nblocks = xscale.shape
    xq = codes.view(m, nblocks, weight.block).double()
    q = blocks.q.view(weight.n, nblocks, weight.block).double()
    scale, offset = blocks.scale.double(), blocks.offset.double()
    y = torch.zeros(m, weight.n, dtype=torch.float64)
    for b in range(nblocks):
        dot = xq[:, b] @ q[:, b].t()  # [M, n], exact: every partial sum is an integer < 2**53
        y += xscale[:, b, None].double() * (scale[:, b] * dot + offset[:, b] * xsum[:, b, None])
    y = y.float().view(*lead, weight.n)
    return y if bias is None else y + bias


def quantized_linear_float(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x W^T (+ bias) in float32 with the dequantized weight: no activation rounding."""
    y = x.float() @ weight.unpack().dequantize().t()
    return y if bias is None else y + bias


def activation_error_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """A bound on |quantized_linear - quantized_linear_float| [M, n] from the activation
    rounding: each code is off by at most half its block's scale, so the error is at most
    ``sum over blocks of xscale / 2 * sum |w|`` (float32 rounding of the sums comes on top)."""
    blocks = weight.unpack()
    _, xscale, _ = quantize_activations(x.reshape(-1, weight.k), weight.block)
    w = blocks.dequantize().abs().view(weight.n, -1, weight.block).sum(dim=-1)  # [n, blocks]
    return (xscale / 2) @ w.t()


@register("quantized_rows", "torch")
def quantized_rows(index: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows ``index`` (int64 [T]) of the quantized weight, dequantized: float32 [T, k] (an
    embedding lookup)."""
    return weight.unpack().rows(index).dequantize()
