"""Torch reference implementations: each op's declaration (signature and contract), the CPU
fallback and the oracle for the triton and native kernels."""

from kernels.reference import attention, cascade, elementwise, quantized, sampling  # noqa: F401  (registers the ops)
