"""GGUF block formats read into BlockWeights without loss: for every block type, random valid
blocks dequantize to exactly what gguf's own dequantization gives for the same bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runtime.gguf import TENSOR_TYPES, unpermute_rows
from runtime.gguf.blocks import BLOCK_TYPES, decode_blocks

# Where each type's blocks keep their float16 scales (d, and dmin or m), in bytes.
_F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_blocks(tensor_type: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row] of a ``tensor_type`` weight [rows, cols]: random
    codes and sub-block scales, finite float16 scales of both signs."""
    kind = gguf.GGMLQuantizationType[tensor_type]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per_block, block_bytes), dtype=np.uint8)
    for at in _F16_FIELDS[tensor_type]:
        scales = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = scales[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def test_every_quantized_tensor_type_has_a_block_form() -> None:
    assert set(BLOCK_TYPES) == set(TENSOR_TYPES) - {"F32", "F16", "BF16"}


@pytest.mark.parametrize("tensor_type", BLOCK_TYPES)
def test_blocks_dequantize_as_gguf_does(tensor_type: str) -> None:
    per_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]][0]
    rows, cols = 6, 2 * per_block
    raw = random_blocks(tensor_type, rows, cols)
    blocks = decode_blocks(raw.reshape(-1), tensor_type, (rows, cols))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[tensor_type])
    assert blocks.shape == (rows, cols)
    assert int(blocks.q.max()) < 2**blocks.bits
    assert blocks.q.dtype == torch.uint8 and blocks.scale.dtype == torch.float32
    np.testing.assert_array_equal(blocks.dequantize().numpy(), expected)
    # The activations are rounded as llama.cpp's for this type: Q8_1 for the types with a
    # free offset, Q8_0 for the symmetric ones, float32 for the K-quants (Q8_K there).
    llama_cpp = {"Q4_1": "q8_1", "Q5_1": "q8_1", "Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0"}
    assert blocks.activations == llama_cpp.get(tensor_type, "f32")


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_floats_read_back_as_gguf_dequantizes_them(tensor_type: str) -> None:
    """Blocks gguf itself writes from float weights (the codes a converter makes)."""
    kind = gguf.GGMLQuantizationType[tensor_type]
    weight = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weight, kind)
    blocks = decode_blocks(raw.reshape(-1), tensor_type, weight.shape)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), gguf.quants.dequantize(raw, kind))


def test_unpermuting_the_blocks_rows_unpermutes_the_weight() -> None:
    raw = random_blocks("Q4_K", 16, 256)
    blocks = decode_blocks(raw.reshape(-1), "Q4_K", (16, 256))
    order = unpermute_rows(torch.arange(16), 2)
    torch.testing.assert_close(
        blocks.rows(order).dequantize(), unpermute_rows(blocks.dequantize(), 2), rtol=0, atol=0
    )


def test_a_byte_count_that_does_not_fit_the_shape_is_refused() -> None:
    raw = random_blocks("Q8_0", 2, 64)
    with pytest.raises(ValueError, match="do not hold Q8_0"):
        decode_blocks(raw.reshape(-1)[:-1], "Q8_0", (2, 64))
