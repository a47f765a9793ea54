"""Linear layers and embedding lookups on quantized block weights (kernels/quantized.py).

``quantized_linear`` computes what the native kernels compute, exactly but for float32
rounding: the activations are quantized per block of the weight's block size, as llama.cpp
quantizes them for its integer dot products (``quantize_activations``, rounded as the weight's
``activations`` format says), each block's integer dot product is exact (float64 holds it),
and the per-block sums are taken in float64. ``quantized_linear_float`` is the float product
with the dequantized weight; the two differ by the activation rounding alone, bounded by
``activation_error_bound``: per block, ``(d / 2 + 127 |d' - d|) * sum|w| + |offset| * |f -
d' * sum(codes)|``, with ``d`` the block's exact scale ``max|x| / 127``, ``d'`` the scale
used and ``f`` the offset's factor used (for ``f32`` the second and third terms are float32
rounding; for ``q8_0`` and ``q8_1``, ``|d' - d| <= 2**-11 d`` where ``d`` is a normal
float16, and the last term is 0 for ``q8_0``, at most ``2**-11 |d * sum(codes)|`` for
``q8_1``).
"""

from __future__ import annotations

import torch
from arbor_kernels.dispatch import register
from arbor_kernels.quantized import QuantizedWeight


def quantize_activations(
    x: torch.Tensor, block: int, activations: str = "f32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float [M, k] per block of ``block`` values: int8 codes [M, k], each block's scale
    and the factor of the weight's offset (float32 [M, k // block] each). A code is ``round(x
    * (127 / max|x|))``, rounded half to even, in float32; an all-zero block has scale 0 and
    codes 0. The scale is ``d = max|x| / 127`` and the factor ``d * sum(codes)`` for
    ``activations`` ``f32``; ``q8_0`` rounds ``d`` to float16 (the factor uses the rounded
    one); ``q8_1`` also rounds the factor, ``d * sum(codes)`` with the unrounded ``d``, to
    float16 (kernels/quantized.py)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=-1)
    # A true division (``127.0 / amax`` would multiply by a rounded reciprocal), as in C++.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0.0)
    codes = torch.round(xb * inverse.unsqueeze(-1)).to(torch.int8)
    total = codes.sum(dim=-1, dtype=torch.int32).float()
    scale = amax.div(torch.full_like(amax, 127.0))
    if activations == "f32":
        return codes.view(m, k), scale, scale * total
    rounded = scale.half().float()
    factor = (scale * total).half().float() if activations == "q8_1" else rounded * total
    return codes.view(m, k), rounded, factor


@register("quantized_linear", "torch")
def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x W^T (+ bias), x float32 [M, k], W the quantized [n, k] weight; float32 [M, n].
    The activations are quantized per block (``quantize_activations``): for each block,
    ``y += xscale * scale * dot(q, xq) + offset * factor``."""
    blocks = weight.unpack()
    lead = x.shape[:-1]
    codes, xscale, factor = quantize_activations(
        x.reshape(-1, weight.k), weight.block, weight.activations
    )
    m, nblocks = xscale.shape
    xq = codes.view(m, nblocks, weight.block).double()
    q = blocks.q.view(weight.n, nblocks, weight.block).double()
    scale, offset = blocks.scale.double(), blocks.offset.double()
    y = torch.zeros(m, weight.n, dtype=torch.float64)
    for b in range(nblocks):
        dot = xq[:, b] @ q[:, b].t()  # [M, n], exact: every partial sum is an integer < 2**53
        y += xscale[:, b, None].double() * scale[:, b] * dot
        y += factor[:, b, None].double() * offset[:, b]
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
    rounding (module docstring): each value the codes stand for, ``code * d'``, is off by at
    most ``d / 2 + 127 |d' - d|``, and the offset's factor by ``|f - d' * sum(codes)|`` more
    (float32 rounding of the sums comes on top)."""
    blocks = weight.unpack()
    flat = x.reshape(-1, weight.k).double()
    codes, used, factor = quantize_activations(flat, weight.block, weight.activations)
    m, nblocks = used.shape
    exact = flat.view(m, nblocks, -1).abs().amax(dim=-1) / 127
    per_value = exact / 2 + 127 * (used.double() - exact).abs()
    total = codes.view(m, nblocks, -1).sum(dim=-1, dtype=torch.float64)
    factor_error = (factor.double() - used.double() * total).abs()
    w = blocks.dequantize().double().abs().view(weight.n, nblocks, -1).sum(dim=-1)  # [n, b]
    bound = per_value @ w.t() + factor_error @ blocks.offset.double().abs().t()
    return bound.float()


@register("quantized_rows", "torch")
def quantized_rows(index: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows ``index`` (int64 [T]) of the quantized weight, dequantized: float32 [T, k] (an
    embedding lookup)."""
    return weight.unpack().rows(index).dequantize()
