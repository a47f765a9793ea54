"""Token-bitmask application in triton: -inf into the logits of disallowed tokens, in place.

Grid (N, cdiv(V, BLOCK_V)): a program takes one bitmask row and BLOCK_V tokens of the logits
row it applies to (``indices[i]``, or row i), reads the BLOCK_V / 32 packed words and writes
only the disallowed positions, so allowed logits and unconstrained rows are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from arbor_kernels.dispatch import register


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [B, V]
    bitmask_ptr,  # [N, W] int32
    indices_ptr,  # [N] int64 (unused without HAS_INDICES)
    vocab_size,
    num_words,
    stride_logits_row,
    stride_logits_col,
    stride_mask_row,
    stride_mask_col,
    HAS_INDICES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    mask_row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    if HAS_INDICES:
        row = tl.load(indices_ptr + mask_row)
    else:
        row = mask_row
    words_idx = offs // 32
    in_vocab = offs < vocab_size
    # Tokens past 32 * W have no bit: they read the word 0, i.e. disallowed.
    words = tl.load(
        bitmask_ptr + mask_row * stride_mask_row + words_idx * stride_mask_col,
        mask=in_vocab & (words_idx < num_words),
        other=0,
    )
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK_V], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(
        logits_ptr + row * stride_logits_row + offs * stride_logits_col,
        neg_inf,
        mask=in_vocab & ~allowed,
    )


@register("apply_token_bitmask", "triton")
def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None,
    block_v: int = 4096,
) -> None:
    """Same contract as ``kernels.ops.apply_token_bitmask``; tensors on one device, any strides.

    block_v: tokens per program (a power of two >= 32).
    """
    num_rows = bitmask.shape[0]
    if num_rows == 0:
        return
    vocab = logits.shape[-1]
    _apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block_v))](
        logits,
        bitmask,
        bitmask if indices is None else indices,
        vocab,
        bitmask.shape[1],
        *logits.stride(),
        *bitmask.stride(),
        HAS_INDICES=indices is not None,
        BLOCK_V=block_v,
    )
