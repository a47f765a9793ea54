"""Launch-parameter helpers shared by the triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def padded_dim(size: int) -> int:
    """The tile width covering ``size``: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(size))


def dot_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """The dtype attention tiles take into ``tl.dot`` (accumulating in float32).

    16-bit inputs stay 16-bit: tensor cores at full rate, and the softmax weights are rounded
    to it before the PV product, as flash attention does. The exception is bfloat16 off CUDA,
    i.e. under the triton interpreter, which gets bfloat16 arithmetic wrong: it upcasts to
    float32 there (float16 runs natively under the interpreter, which is how the tests cover
    the 16-bit path).
    """
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and device.type == "cuda":
        return tl.bfloat16
    return tl.float32


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for float32 tiles: three-pass tf32 (close to float32 accuracy on
    tensor cores) for float32 inputs; plain tf32 for upcast bfloat16, which it holds exactly."""
    return "tf32x3" if dtype == torch.float32 else "tf32"
