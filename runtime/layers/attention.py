"""Self-attention over the paged KV pool: write the new K/V, then attend through the table."""

from __future__ import annotations

import arbor_kernels as kernels
import torch

from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.layers.basic import RMSNorm


class PagedAttention(torch.nn.Module):
    """One layer's attention. Scores are scaled by ``scale`` (default head_dim ** -0.5). With a
    ``window`` (0: none), a query at position p sees only the keys at positions k with
    p - window < k <= p (sliding-window attention; the kernels read no key before the
    window); such a layer decodes without a cascade plan, whose shared-prefix kernel takes no
    window."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self._no_norm = torch.empty(0)  # decode_self_attention's "no q/k norm"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (already rotated). Returns [T, H * D]."""
        pool = batch.kv_pool
        out_cache_loc, table, rows = self._slots(batch)
        pool.write(self.layer_id, out_cache_loc, k, v)
        k_buffer, v_buffer = pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id]
        seq_lens = batch.seq_lens
        if batch.mode is ForwardMode.DECODE:
            out = self._decode(q, k_buffer, v_buffer, batch, rows, seq_lens)
        elif batch.mode is ForwardMode.EXTEND:
            out = kernels.extend_attention(
                q, k_buffer, v_buffer, table, rows, seq_lens, batch.extend_lens, self.scale,
                self.window,
            )  # fmt: skip
        else:
            e, t = batch.num_extend_reqs, batch.num_extend_tokens
            extend_out = kernels.extend_attention(
                q[:t], k_buffer, v_buffer, table, rows[:e], seq_lens[:e],
                batch.extend_lens[:e], self.scale, self.window,
            )  # fmt: skip
            decode_out = self._decode(q[t:], k_buffer, v_buffer, batch, rows[e:], seq_lens[e:])
            out = torch.cat([extend_out, decode_out])
        return out.reshape(q.shape[0], -1)

    def _slots(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the new tokens' slots, the slot table, the batch's rows in it) for this layer: the
        window slots when it keeps its KV in a window pool (``batch.window``)."""
        if self.window and batch.window is not None:
            return batch.window.out_cache_loc, batch.window.table, batch.window.rows
        return batch.out_cache_loc, batch.req_to_token, batch.req_pool_indices

    def fuses(self, batch: ForwardBatch) -> bool:
        """Whether ``forward_decode`` runs ``batch``: a decode batch on the CPU without a
        cascade plan. (On CUDA the decode ops stay separate: they are captured in graphs.)"""
        return (
            batch.mode is ForwardMode.DECODE
            and batch.cascade is None
            and batch.input_ids.device.type == "cpu"
        )

    def forward_decode(
        self,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        norms: tuple[RMSNorm | None, RMSNorm | None],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """A decode batch (``fuses(batch)``) from its QKV projection qkv: [B, (H + 2 Hkv) D],
        per-head q/k ``norms`` (both or neither) and rotation, K/V write and attention in one
        op. Returns [B, H * D]."""
        pool = batch.kv_pool
        q_norm, k_norm = norms
        if q_norm is None or k_norm is None:
            q_weight = k_weight = self._no_norm
            eps = 0.0
        else:
            q_weight, k_weight, eps = q_norm.weight, k_norm.weight, q_norm.eps
        out_cache_loc, table, rows = self._slots(batch)
        return kernels.decode_self_attention(
            qkv, *cos_sin, q_weight, k_weight, eps,
            pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id], out_cache_loc,
            table, rows, batch.seq_lens, self.scale, self.window,
        )  # fmt: skip

    def forward_last_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write every new token's K/V, but attend only for the rows ``batch.logit_reqs`` names,
        each its request's last new token (q: those rows, [N, H, D]): each attends to its whole
        sequence, as a decode query does. Returns [N, H * D]."""
        assert batch.logit_reqs is not None
        pool = batch.kv_pool
        out_cache_loc, table, rows = self._slots(batch)
        pool.write(self.layer_id, out_cache_loc, k, v)
        reqs = batch.logit_reqs
        out = kernels.decode_attention(
            q, pool.k_buffers[self.layer_id], pool.v_buffers[self.layer_id],
            table, rows[reqs], batch.seq_lens[reqs], self.scale, self.window,
        )  # fmt: skip
        return out.reshape(q.shape[0], -1)

    def _decode(
        self,
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention of the batch's one-token requests, q: [Bd, H, D]; with a cascade
        plan (ignored by a windowed layer), sharers attend to their own suffix alone and to the
        shared prefix together."""
        plan = batch.cascade
        _, table, _ = self._slots(batch)
        if plan is None or self.window:
            return kernels.decode_attention(
                q, k_buffer, v_buffer, table, rows, seq_lens, self.scale, self.window
            )
        out, lse = kernels.decode_attention_with_lse(
            q, k_buffer, v_buffer, table, rows, plan.kv_start, seq_lens, self.scale
        )
        shared_out, shared_lse = kernels.shared_prefix_attention(
            q[plan.sharers], k_buffer, v_buffer, table,
            plan.prefix_rows, plan.sharer_offsets, plan.prefix_lens, self.scale,
        )  # fmt: skip
        own_out, own_lse = out[plan.sharers], lse[plan.sharers]
        kernels.merge_attention_states(own_out, own_lse, shared_out, shared_lse)
        out[plan.sharers] = own_out
        return out
