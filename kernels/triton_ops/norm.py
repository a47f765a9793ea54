"""RMSNorm and fused residual-add + RMSNorm in triton, numerically as the torch reference.

Grid (rows,): one program normalises one row of ``hidden`` values held in a single tile, in
float32; the normalised row is cast to x's dtype before the weight multiplies it, as Hugging
Face models do. The fused op also writes x + residual, so the residual stream is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, hidden]
    residual_ptr,  # [N, hidden] (unused without HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [N, hidden]
    residual_out_ptr,  # [N, hidden] x + residual (unused without HAS_RESIDUAL)
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden + offs, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + offs, out, mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden).contiguous()
    out = torch.empty(x2d.shape, dtype=torch.result_type(weight, x), device=x.device)
    residual2d = residual_out = None
    if residual is not None:
        residual2d = residual.reshape(-1, hidden).contiguous()
        residual_out = torch.empty(x2d.shape, dtype=torch.result_type(x, residual), device=x.device)
    if x2d.shape[0]:
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            x2d if residual2d is None else residual2d,
            weight.contiguous(),
            out,
            out if residual_out is None else residual_out,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=min(16, max(1, triton.next_power_of_2(hidden) // 256)),
        )
    if residual_out is not None:
        residual_out = residual_out.view(x.shape)
    return out.view(x.shape), residual_out


@register("rms_norm", "triton", graph_safe=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``kernels.ops.rms_norm``: x [..., hidden], weight [hidden], one device."""
    return _launch(x, None, weight, eps)[0]


@register("fused_add_rms_norm", "triton", graph_safe=True)
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.ops.fused_add_rms_norm``; x and residual are not modified."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
