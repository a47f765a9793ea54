"""Torch reference implementations: each op's declaration (signature and contract), the CPU
fallback and the oracle for the triton and native kernels."""

from arbor_kernels.reference import (  # noqa: F401  (registers the ops)
    attention,
    cascade,
    elementwise,
    kv_chunks,
    linear,
    quantized,
    sampling,
)
