"""Kernels: torch reference implementations and triton kernels behind one dispatch point."""

from kernels import reference  # noqa: F401  (registers the torch implementations)
from kernels.dispatch import (
    BACKENDS,
    graph_safe,
    kernel_backend,
    native_available,
    set_kernel_backend,
)
from kernels.ops import (
    apply_rotary_emb,
    apply_token_bitmask,
    decode_attention,
    decode_attention_with_lse,
    decode_self_attention,
    extend_attention,
    fused_add_rms_norm,
    gather_kv_chunks,
    merge_attention_states,
    quantized_linear,
    quantized_rows,
    rms_norm,
    row_max_argmax,
    sample_from_probs,
    shared_prefix_attention,
    silu_and_mul,
)
from kernels.reference.sampling import filter_probs, row_uniform

__all__ = [
    "BACKENDS",
    "apply_rotary_emb",
    "apply_token_bitmask",
    "decode_attention",
    "decode_attention_with_lse",
    "decode_self_attention",
    "extend_attention",
    "filter_probs",
    "fused_add_rms_norm",
    "gather_kv_chunks",
    "graph_safe",
    "kernel_backend",
    "merge_attention_states",
    "native_available",
    "quantized_linear",
    "quantized_rows",
    "rms_norm",
    "row_max_argmax",
    "row_uniform",
    "sample_from_probs",
    "set_kernel_backend",
    "shared_prefix_attention",
    "silu_and_mul",
]
