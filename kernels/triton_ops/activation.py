"""SiLU-and-mul in triton: silu(gate) * up in one pass over the fused gate|up projection.

Grid (rows, cdiv(I, BLOCK)): each program reads BLOCK gate and BLOCK up values of one row,
computes in float32 and writes BLOCK outputs, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [N, 2 * I] contiguous: gate then up
    out_ptr,  # [N, I] contiguous
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@register("silu_and_mul", "triton", graph_safe=True)
def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Same contract as ``kernels.ops.silu_and_mul``: x [..., 2I] -> [..., I], x's dtype."""
    inter = x.shape[-1] // 2
    x2d = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2d.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (x2d.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2d, out, inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)
