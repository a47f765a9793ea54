"""Weights held in quantized blocks: GGUF's block formats, read without loss into one form.

Every GGUF block type (Q8_0, Q4_0, Q4_1, Q5_x, the K-quants) is an affine code per block of
16 or 32 weights along the input dimension: ``w = scale * q + offset`` with an unsigned integer
``q``. ``BlockWeights`` is that form, plain; ``pack`` lays it out for the kernels
(``kernels.quantized_linear``, ``kernels.quantized_rows``), which never dequantize the whole
weight.

The packed layout (``QuantizedWeight.data``, uint8 [groups, blocks, stride]) serves an integer
dot product that computes 16 output rows at once: the rows are taken in groups of 16 (n padded
with zero rows), and each (group, block) is one contiguous run of ``stride`` bytes:

- the codes, 64 bytes per step: 16 rows x 4 consecutive k-values, row-major (``[row][4]``),
  so one 512-bit VNNI ``vpdpbusd`` multiplies all 16 rows by 4 broadcast activation bytes.
  8-bit codes take ``block / 4`` such steps; 4-bit codes are two per byte, ``block / 8``
  steps, the low nibble holding k-values ``8j..8j+3`` and the high nibble ``8j+4..8j+7``;
- then the 16 rows' scales and the 16 rows' offsets, as float16 when every scale and offset
  of the weight is exactly a float16 (GGUF's own are) and float32 otherwise.

The kernels quantize the activations per block to int8 (scale ``d = max|x| / 127``); a
weight's ``activations`` says how ``d`` and the offset's factor ``d * sum(codes)`` are rounded
(``ACTIVATION_FORMATS``), so that a GGUF weight computes what llama.cpp computes for its type:
``f32`` keeps both in float32; ``q8_0`` rounds ``d`` to float16 (llama.cpp's Q8_0
activations, which it pairs with Q8_0, Q4_0 and Q5_0 weights: their offset is ``-2**(bits-1)
* scale``, so the factor stays ``d * sum(codes)`` with the rounded ``d``, exactly); ``q8_1``
also rounds the factor to float16, computed with the unrounded ``d`` (llama.cpp's Q8_1, for
Q4_1 and Q5_1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16  # output rows per group
ACTIVATION_FORMATS = ("f32", "q8_0", "q8_1")  # how activation block scales are rounded


@dataclass(frozen=True)
class BlockWeights:
    """A weight [n, k] as blocks of ``block`` values along k: ``w[r, c] = scale[r, c // block]
    * q[r, c] + offset[r, c // block]``. ``q`` is uint8 [n, k] with values below
    ``2 ** bits`` (bits 4 or 8); ``scale`` and ``offset`` are float32 [n, k // block].
    ``activations``: how the kernels round the activations' block scales, one of
    ``ACTIVATION_FORMATS`` (module docstring)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    block: int
    activations: str = "f32"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATION_FORMATS:
            raise ValueError(
                f"activations {self.activations!r}: use one of {', '.join(ACTIVATION_FORMATS)}"
            )
        n, k = self.q.shape
        if self.bits not in (4, 8) or self.block not in (16, 32) or k % self.block:
            raise ValueError(f"unsupported blocks: bits {self.bits}, block {self.block}, k {k}")
        want = (n, k // self.block)
        if tuple(self.scale.shape) != want or tuple(self.offset.shape) != want:
            raise ValueError(f"scale/offset must be {want}, got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return int(n), int(k)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k]."""
        n, k = self.shape
        q = self.q.float().view(n, k // self.block, self.block)
        w = q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> BlockWeights:
        """The blocks of rows ``index`` (a row permutation or selection)."""
        return BlockWeights(
            self.q[index], self.scale[index], self.offset[index], self.bits, self.block,
            self.activations,
        )  # fmt: skip


class QuantizedWeight:
    """``BlockWeights`` in the layout the kernels read (module docstring); ``unpack`` gives
    them back exactly."""

    def __init__(
        self, data: torch.Tensor, n: int, k: int, bits: int, block: int, half_scales: bool,
        activations: str = "f32",
    ) -> None:  # fmt: skip
        self.data = data  # uint8 [groups, k // block, stride]
        self.n, self.k = n, k
        self.bits, self.block = bits, block
        self.half_scales = half_scales
        self.activations = activations

    @property
    def code_bytes(self) -> int:
        """Bytes of codes in one (group, block)."""
        return ROWS * self.block * self.bits // 8

    def nbytes(self) -> int:
        return self.data.numel()

    def unpack(self) -> BlockWeights:
        """The ``BlockWeights`` this was packed from, bit for bit."""
        groups, nblocks, _ = self.data.shape
        step = 4 if self.bits == 8 else 8
        codes = self.data[:, :, : self.code_bytes].reshape(groups, nblocks, -1, ROWS, 4)
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=3)  # [g, b, steps, 2, 16, 4]
            codes = codes.transpose(3, 4)  # [g, b, steps, 16, 2, 4]
        # -> [g, 16, b, steps, step] -> [n_padded, k]
        q = codes.reshape(groups, nblocks, self.block // step, ROWS, step).permute(0, 3, 1, 2, 4)
        q = q.reshape(groups * ROWS, self.k)[: self.n]
        dtype = torch.float16 if self.half_scales else torch.float32
        tail = self.data[:, :, self.code_bytes :].contiguous().view(dtype).float()
        tail = tail.view(groups, nblocks, 2, ROWS).permute(2, 0, 3, 1)  # [2, g, 16, b]
        scale, offset = tail.reshape(2, groups * ROWS, nblocks)[:, : self.n]
        return BlockWeights(
            q.contiguous(), scale.contiguous(), offset.contiguous(), self.bits, self.block,
            self.activations,
        )  # fmt: skip


def _fits_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def pack(blocks: BlockWeights) -> QuantizedWeight:
    """``blocks`` laid out for ``kernels.quantized_linear`` and ``kernels.quantized_rows``."""
    n, k = blocks.shape
    bits, block = blocks.bits, blocks.block
    groups, nblocks = -(-n // ROWS), k // block
    padded = groups * ROWS
    q = torch.zeros(padded, k, dtype=torch.uint8)
    q[:n] = blocks.q
    step = 4 if bits == 8 else 8
    # [g, 16, b, steps, step] -> [g, b, steps, 16, step]
    codes = q.view(groups, ROWS, nblocks, block // step, step).permute(0, 2, 3, 1, 4)
    if bits == 4:
        codes = codes[..., :4] | (codes[..., 4:] << 4)
    codes = codes.reshape(groups, nblocks, -1)
    half = _fits_half(blocks.scale) and _fits_half(blocks.offset)
    dtype = torch.float16 if half else torch.float32
    tail = torch.zeros(2, padded, nblocks, dtype=dtype)
    tail[0, :n], tail[1, :n] = blocks.scale, blocks.offset
    # [2, g, 16, b] -> [g, b, 2, 16], as bytes
    tail = tail.view(2, groups, ROWS, nblocks).permute(1, 3, 0, 2).contiguous()
    tail = tail.view(groups, nblocks, -1).view(torch.uint8)
    data = torch.cat((codes, tail), dim=2).contiguous()
    return QuantizedWeight(data, n, k, bits, block, half, blocks.activations)
