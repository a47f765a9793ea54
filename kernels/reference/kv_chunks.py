"""Copying K/V out of the pool into chunk payloads (the KV disk tier's write path)."""

from __future__ import annotations

import torch
from arbor_kernels.dispatch import register


@register("gather_kv_chunks", "torch")
def gather_kv_chunks(
    out: torch.Tensor,
    out_rows: torch.Tensor,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """In place: ``out[out_rows[c], layer, 0 | 1, t] = k | v_buffers[layer][slots[c * T + t]]``
    for every chunk ``c``, layer and position ``t`` of the chunk.

    out: ``[R, layers, 2, T, kv_heads, head_dim]``, contiguous, on the pool's device and in its
    dtype. out_rows: ``[C]`` int64, distinct rows of ``out``. k_buffers, v_buffers: one
    ``[slots, kv_heads, head_dim]`` tensor per layer. slots: ``[C * T]`` int64, chunk ``c``'s
    slots at ``[c * T, (c + 1) * T)``. Rows of ``out`` not in ``out_rows`` are untouched.
    """
    chunks, tokens = out_rows.numel(), out.shape[3]
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers, strict=True)):
        for kind, buffer in enumerate((k, v)):
            rows = torch.index_select(buffer, 0, slots).view(chunks, tokens, *buffer.shape[1:])
            out[:, layer, kind].index_copy_(0, out_rows, rows)
