"""The native CPU implementations, registered under backend "native" when the build loads."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.dispatch import register

_ext = cpu_native.load()
_NO_START = torch.empty(0, dtype=torch.int64)


def available() -> bool:
    return _ext is not None


if _ext is not None:
    ext = _ext

    @register("extend_attention", "native")
    def extend_attention(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        return ext.extend_attention(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_lens, sm_scale
        )

    @register("decode_attention", "native")
    def decode_attention(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        out, _ = ext.decode_attention(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, _NO_START, seq_lens, sm_scale
        )
        return out

    @register("decode_attention_with_lse", "native")
    def decode_attention_with_lse(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        kv_start: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = ext.decode_attention(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, kv_start, seq_lens, sm_scale
        )
        return out, lse

    @register("shared_prefix_attention", "native")
    def shared_prefix_attention(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        prefix_rows: torch.Tensor,
        sharer_offsets: torch.Tensor,
        prefix_lens: torch.Tensor,
        sm_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = ext.shared_prefix_attention(
            q, k_buffer, v_buffer, req_to_token, prefix_rows, sharer_offsets, prefix_lens, sm_scale
        )
        return out, lse

    @register("merge_attention_states", "native")
    def merge_attention_states(
        out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> None:
        ext.merge_attention_states(out_a, lse_a, out_b, lse_b)

    @register("rms_norm", "native")
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ext.rms_norm(x, weight, eps)

    @register("fused_add_rms_norm", "native")
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, total = ext.fused_add_rms_norm(x, residual, weight, eps)
        return out, total

    @register("apply_rotary_emb", "native")
    def apply_rotary_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = ext.apply_rotary_emb(q, k, cos, sin)
        return q_out, k_out

    @register("silu_and_mul", "native")
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return ext.silu_and_mul(x)

    @register("apply_token_bitmask", "native")
    def apply_token_bitmask(
        logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None
    ) -> None:
        ext.apply_token_bitmask(logits, bitmask, _NO_START if indices is None else indices)

    @register("row_max_argmax", "native")
    def row_max_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = ext.row_max_argmax(logits)
        return values, indices
