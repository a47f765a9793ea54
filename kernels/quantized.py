"""Weights held in quantized blocks: GGUF's block formats, read without loss into one form.

Every GGUF block type (Q8_0, Q4_0, Q4_1, Q5_x, the K-quants) is an affine code per block of
16 or 32 weights along the input dimension: ``w = scale * q + offset`` with an unsigned integer
``q``. ``BlockWeights`` is that form, plain; ``pack`` lays it out for the kernels
(``kernels.quantized_linear``, ``kernels.quantized_rows``), which never dequantize the whole
weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockWeights:
    """A weight [n, k] as blocks of ``block`` values along k: ``w[r, c] = scale[r, c // block]
    * q[r, c] + offset[r, c // block]``. ``q`` is uint8 [n, k] with values below
    ``2 ** bits`` (bits 4 or 8); ``scale`` and ``offset`` are float32 [n, k // block]."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    block: int

    def __post_init__(self) -> None:
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
            self.q[index], self.scale[index], self.offset[index], self.bits, self.block
        )


class QuantizedWeight:
    """``BlockWeights`` in the layout the kernels read (private to kernels/)."""

    def __init__(self, blocks: BlockWeights) -> None:
        self.blocks = blocks
        self.n, self.k = blocks.shape
        self.bits, self.block = blocks.bits, blocks.block

    def nbytes(self) -> int:
        b = self.blocks
        return b.q.numel() * b.bits // 8 + b.scale.nbytes + b.offset.nbytes


def pack(blocks: BlockWeights) -> QuantizedWeight:
    """``blocks`` laid out for ``kernels.quantized_linear`` and ``kernels.quantized_rows``."""
    return QuantizedWeight(blocks)
