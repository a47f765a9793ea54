"""The native CPU implementations, registered under backend "native" when the build loads.

The extension's functions take the ops' arguments as declared (kernels/ops.py), checked by the
compiler in its C++ binding; the others reach theirs through an adapter."""

from __future__ import annotations

import torch
from arbor_kernels import cpu_native
from arbor_kernels.dispatch import deterministic, register
from arbor_kernels.quantized import ACTIVATION_FORMATS, QuantizedWeight

_ext = cpu_native.load()
_NO_START = torch.empty(0, dtype=torch.int64)
_SAME_ARGUMENTS = (
    "extend_attention",
    "decode_self_attention",
    "shared_prefix_attention",
    "merge_attention_states",
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary_emb",
    "silu_and_mul",
    "row_max_argmax",
    "gather_kv_chunks",
    "fixed_order_linear",
)


def load_error() -> Exception | None:
    """Why the extension did not load (None when it did)."""
    return cpu_native.load_error() if _ext is None else None


if _ext is not None:
    ext = _ext
    ext.set_deterministic(deterministic())  # the mode chosen before the build loaded
    for _op in _SAME_ARGUMENTS:
        register(_op, "native")(getattr(ext, _op))
    # The extension's decode attention takes kv_start and returns the lse too.
    register("decode_attention_with_lse", "native")(ext.decode_attention)

    @register("decode_attention", "native")
    def decode_attention(
        q: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """From each sequence's start (no kv_start before seq_lens), without the lse."""
        out, _ = ext.decode_attention(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, _NO_START, seq_lens,
            sm_scale, window,
        )  # fmt: skip
        return out

    @register("apply_token_bitmask", "native")
    def apply_token_bitmask(
        logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None
    ) -> None:
        ext.apply_token_bitmask(logits, bitmask, _NO_START if indices is None else indices)

    @register("quantized_linear", "native")
    def quantized_linear(
        x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return ext.quantized_linear(
            x, weight.data, weight.n, weight.bits, weight.block, weight.half_scales,
            ACTIVATION_FORMATS.index(weight.activations), bias,
        )  # fmt: skip

    @register("quantized_rows", "native")
    def quantized_rows(index: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        return ext.quantized_rows(
            index, weight.data, weight.n, weight.bits, weight.block, weight.half_scales
        )
