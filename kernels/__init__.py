"""Kernels: torch reference implementations and triton kernels behind one dispatch point."""

from kernels import reference  # noqa: F401  (registers the torch implementations)
from kernels.dispatch import BACKENDS, kernel_backend, set_kernel_backend
from kernels.ops import (
    apply_rotary_emb,
    apply_token_bitmask,
    decode_attention,
    extend_attention,
    fused_add_rms_norm,
    rms_norm,
    sample_from_probs,
    silu_and_mul,
)
from kernels.reference.sampling import filter_probs, row_uniform

__all__ = [
    "BACKENDS",
    "apply_rotary_emb",
    "apply_token_bitmask",
    "decode_attention",
    "extend_attention",
    "filter_probs",
    "fused_add_rms_norm",
    "kernel_backend",
    "rms_norm",
    "row_uniform",
    "sample_from_probs",
    "set_kernel_backend",
    "silu_and_mul",
]
