"""The ops the runtime calls. Each is declared once, by its torch reference (kernels/reference/:
the signature, and the contract in its docstring); here it becomes the op, which runs the
implementation ``dispatch.resolve`` picks for its first argument's device."""

from __future__ import annotations

from arbor_kernels.dispatch import dispatched
from arbor_kernels.reference import (
    attention,
    cascade,
    elementwise,
    kv_chunks,
    linear,
    quantized,
    sampling,
)

extend_attention = dispatched(attention.extend_attention)
decode_attention = dispatched(attention.decode_attention)
decode_self_attention = dispatched(attention.decode_self_attention)
decode_attention_with_lse = dispatched(cascade.decode_attention_with_lse)
shared_prefix_attention = dispatched(cascade.shared_prefix_attention)
merge_attention_states = dispatched(cascade.merge_attention_states)
rms_norm = dispatched(elementwise.rms_norm)
fused_add_rms_norm = dispatched(elementwise.fused_add_rms_norm)
apply_rotary_emb = dispatched(elementwise.apply_rotary_emb)
silu_and_mul = dispatched(elementwise.silu_and_mul)
quantized_linear = dispatched(quantized.quantized_linear)
quantized_rows = dispatched(quantized.quantized_rows)
fixed_order_linear = dispatched(linear.fixed_order_linear)
apply_token_bitmask = dispatched(sampling.apply_token_bitmask)
row_max_argmax = dispatched(sampling.row_max_argmax)
sample_from_probs = dispatched(sampling.sample_from_probs)
gather_kv_chunks = dispatched(kv_chunks.gather_kv_chunks)
