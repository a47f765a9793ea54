"""Torch reference implementations: the CPU path and the oracle for the triton kernels."""

from kernels.reference import attention, cascade, elementwise, sampling  # noqa: F401  (registers the ops)
