"""GGUF's block formats read into ``kernels.quantized.BlockWeights`` without loss.

Each type is an affine code per block of 16 or 32 weights along a row: ``w = scale * q +
offset``. The legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) have one float16 ``d`` (and ``m``)
per 32 weights; the K-quants pack 256 weights as sub-blocks of 32 (Q4_K, Q5_K: ``d * sc`` and
``-dmin * m``, 6-bit sc and m) or of 16 (Q6_K, Q2_K, Q3_K). Signed codes become unsigned ones
with the sign in the offset (Q8_0: ``q + 128``, offset ``-128 d``); 5- and 6-bit codes are held
as 8-bit ``q``, 2- and 3-bit codes as 4-bit ``q``. Every product here is exact in float32
(a float16 scale times small integers), so ``BlockWeights.dequantize`` gives the same numbers
as ``gguf.quants.dequantize`` of the same bytes.

All decoding is vectorized over a tensor's blocks: an array [blocks, bytes per block] in,
(q [blocks, weights], scale and offset [blocks, sub-blocks]) out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from arbor_kernels.quantized import BlockWeights

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # q uint8, scale, offset float32


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _fields(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unpack ``packed`` [blocks, chunks, width] (uint8) into its ``bits``-wide fields, lowest
    first: [blocks, chunks * (8 // bits) * width], field s of byte j of chunk c at index
    ``(c * (8 // bits) + s) * width + j`` (how ggml lays out every packed code)."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = (packed[:, :, None, :] >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(packed.shape[0], -1)


def _low_bits(blocks: np.ndarray, start: int, width: int, chunks: int, bits: int) -> np.ndarray:
    """The codes packed in bytes [start, start + chunks * width) of each block."""
    packed = blocks[:, start : start + chunks * width].reshape(-1, chunks, width)
    return _fields(packed, bits)


def _q8_0(blocks: np.ndarray) -> Decoded:
    d = _f16(blocks, 0)
    q = blocks[:, 2:34] ^ np.uint8(0x80)  # int8 x as uint8 x + 128
    return q, d, -128 * d


def _q4_0(blocks: np.ndarray) -> Decoded:
    d = _f16(blocks, 0)
    return _low_bits(blocks, 2, 16, 1, 4), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Decoded:
    return _low_bits(blocks, 4, 16, 1, 4), _f16(blocks, 0), _f16(blocks, 2)


def _high_bit_32(blocks: np.ndarray, at: int) -> np.ndarray:
    """Bit j of the little-endian uint32 at byte ``at``, for j < 32: [blocks, 32]."""
    return np.unpackbits(blocks[:, at : at + 4], axis=-1, bitorder="little")


def _q5_0(blocks: np.ndarray) -> Decoded:
    d = _f16(blocks, 0)
    q = _low_bits(blocks, 6, 16, 1, 4) | (_high_bit_32(blocks, 2) << np.uint8(4))
    return q, d, -16 * d


def _q5_1(blocks: np.ndarray) -> Decoded:
    q = _low_bits(blocks, 8, 16, 1, 4) | (_high_bit_32(blocks, 4) << np.uint8(4))
    return q, _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes [blocks, 12] -> the eight 6-bit scales and mins, [blocks, 8]
    each: bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold
    the low 4 bits of scales (low nibble) and mins (high nibble) 4-7, whose top 2 bits are the
    top bits of bytes 0-3 and 4-7."""
    low, high, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (mixed & 15) | ((low >> 2) & 48)], axis=-1)
    mins = np.concatenate([high & 63, (mixed >> 4) | ((high >> 2) & 48)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> Decoded:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    return _low_bits(blocks, 16, 32, 4, 4), d * scales, -(dmin * mins)


def _q5_k(blocks: np.ndarray) -> Decoded:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _low_bits(blocks, 48, 32, 4, 4) | (_low_bits(blocks, 16, 32, 1, 1) << np.uint8(4))
    return q, d * scales, -(dmin * mins)


def _q6_k(blocks: np.ndarray) -> Decoded:
    q = _low_bits(blocks, 0, 64, 2, 4) | (_low_bits(blocks, 128, 32, 2, 2) << np.uint8(4))
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, -32 * scale


def _q2_k(blocks: np.ndarray) -> Decoded:
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    packed = blocks[:, 0:16]
    scale = d * (packed & 15).astype(np.float32)
    offset = -(dmin * (packed >> 4).astype(np.float32))
    return _low_bits(blocks, 16, 32, 2, 2), scale, offset


def _q3_k(blocks: np.ndarray) -> Decoded:
    d = _f16(blocks, 108)
    # 16 6-bit scales: low 4 bits in bytes 96-103 (low nibbles first), top 2 in 104-107.
    low = _low_bits(blocks, 96, 8, 1, 4)
    high = _low_bits(blocks, 104, 4, 1, 2)
    scale = d * ((low | (high << np.uint8(4))).astype(np.float32) - 32)
    # A code is its 2 low bits, minus 4 where its hmask bit is clear: stored plus 4 as 0..7.
    q = _low_bits(blocks, 32, 32, 2, 2) | (_low_bits(blocks, 0, 32, 1, 1) << np.uint8(2))
    return q, scale, -4 * scale


# How llama.cpp quantizes the activations it multiplies each type with, where Arbor's blocks
# can do the same (kernels/quantized.py, ACTIVATION_FORMATS). The K-quants meet Q8_K there, one
# float32 scale per 256 values; they keep float32 scales per 16 or 32 here.
_ACTIVATIONS = {"Q8_0": "q8_0", "Q4_0": "q8_0", "Q5_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1"}
# ggml type -> (weights per block, bytes per block, bits of q, weights per scale, decoder).
_FORMATS: dict[str, tuple[int, int, int, int, Callable[[np.ndarray], Decoded]]] = {
    "Q8_0": (32, 34, 8, 32, _q8_0),
    "Q4_0": (32, 18, 4, 32, _q4_0),
    "Q4_1": (32, 20, 4, 32, _q4_1),
    "Q5_0": (32, 22, 8, 32, _q5_0),
    "Q5_1": (32, 24, 8, 32, _q5_1),
    "Q2_K": (256, 84, 4, 16, _q2_k),
    "Q3_K": (256, 110, 4, 16, _q3_k),
    "Q4_K": (256, 144, 4, 32, _q4_k),
    "Q5_K": (256, 176, 8, 32, _q5_k),
    "Q6_K": (256, 210, 8, 16, _q6_k),
}
# The block types a quantized weight keeps as they are (``quantization=gguf``).
BLOCK_TYPES = tuple(_FORMATS)


def decode_blocks(raw: np.ndarray, tensor_type: str, shape: tuple[int, int]) -> BlockWeights:
    """The weight [n, k] = ``shape`` whose GGUF bytes (type ``tensor_type``, one of
    ``BLOCK_TYPES``) are ``raw`` (uint8, rows one after another), as ``BlockWeights``.
    ValueError for a byte count or row length that does not fit the type."""
    per_block, block_bytes, bits, group, decoder = _FORMATS[tensor_type]
    n, k = shape
    if k % per_block or raw.size != n * (k // per_block) * block_bytes:
        raise ValueError(f"{raw.size} bytes do not hold {tensor_type} weights of shape {shape}")
    q, scale, offset = decoder(raw.reshape(-1, block_bytes))
    return BlockWeights(
        torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(scale, np.float32).reshape(n, k // group)),
        torch.from_numpy(np.ascontiguousarray(offset, np.float32).reshape(n, k // group)),
        bits,
        group,
        _ACTIVATIONS.get(tensor_type, "f32"),
    )
