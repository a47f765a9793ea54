"""Linear layers and embeddings whose weights stay in GGUF blocks (``quantization=gguf``).

The model is built with the plain layers (runtime/layers/basic.py, parallel.py); its loader
collects the ``BlockWeights`` a GGUF file gives for them and ``QuantizedLinear.of`` /
``QuantizedEmbedding`` take their place once every piece is read. The kernels
(``kernels.quantized_linear``, ``kernels.quantized_rows``) read the packed blocks; nothing here
dequantizes a whole weight. They run on one rank only (no tensor parallelism).
"""

from __future__ import annotations

import arbor_kernels as kernels
import torch
import torch.nn.functional as F
from arbor_kernels.quantized import BlockWeights, QuantizedWeight, pack

from runtime.layers.basic import Linear

# A stacked piece's weight: packed blocks, or floats (a piece the file holds as F16/F32).
Piece = QuantizedWeight | torch.Tensor


class QuantizedLinear(torch.nn.Module):
    """y = x W^T (+ b), W stacked from ``pieces`` along the output features (q|k|v,
    gate|up), each packed blocks or a float matrix [rows, in]. x: [M, in] in the model's
    dtype; y: [M, sum of rows] in the same dtype (the kernels compute in float32)."""

    def __init__(self, pieces: list[Piece], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.pieces = pieces
        self.bias = None if bias is None else bias.float()

    @classmethod
    def of(cls, linear: Linear, blocks: dict[str, BlockWeights]) -> QuantizedLinear:
        """The loaded ``linear`` with its stacked pieces named in ``blocks`` held as those
        blocks (the others keep their float rows). Pieces of one block format are packed as
        one weight, so the layer is one kernel call."""
        whole: list[BlockWeights | torch.Tensor] = []
        for name, (offset, size) in linear.shard_offsets.items():
            piece = blocks.get(name)
            whole.append(piece if piece is not None else linear.weight[offset : offset + size])
        merged = _merge_formats(whole)
        pieces: list[Piece] = [
            pack(p) if isinstance(p, BlockWeights) else p.detach().float().clone() for p in merged
        ]
        return cls(pieces, None if linear.bias is None else linear.bias.detach())

    def nbytes(self) -> int:
        """Bytes the weights and bias hold."""
        held = sum(p.nbytes() if isinstance(p, QuantizedWeight) else p.nbytes for p in self.pieces)
        return held + (0 if self.bias is None else self.bias.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if len(self.pieces) == 1:
            y = _piece_linear(x32, self.pieces[0], self.bias)
        else:
            y = torch.cat([_piece_linear(x32, p, None) for p in self.pieces], dim=-1)
            if self.bias is not None:
                y = y + self.bias
        return y.to(x.dtype)


class QuantizedEmbedding(torch.nn.Module):
    """The token embedding as packed blocks [vocab, dim]: looked up by row, and, for a model
    with tied embeddings, also its LM head (``logits``)."""

    def __init__(self, blocks: BlockWeights, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_blocks = pack(blocks)
        self.dtype = dtype

    def nbytes(self) -> int:
        return self.weight_blocks.nbytes()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64. Returns [T, dim] in the model's dtype."""
        return kernels.quantized_rows(ids, self.weight_blocks).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, dim] -> float32 logits [N, vocab] against the embedding rows."""
        return kernels.quantized_linear(hidden.float(), self.weight_blocks, None)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights as held: float parameters, projections packed for oneDNN
    (``Linear.pack``), and the quantized layers' blocks (``QuantizedWeight.nbytes``)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            total += module.nbytes()
        elif isinstance(module, Linear) and module.packed is not None:
            total += module.packed.numel() * module.packed.element_size()
    return total


def _piece_linear(x: torch.Tensor, piece: Piece, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(piece, QuantizedWeight):
        return kernels.quantized_linear(x, piece, bias)
    if kernels.deterministic():
        return kernels.fixed_order_linear(x, piece, bias)
    return F.linear(x, piece, bias)


def _merge_formats(
    pieces: list[BlockWeights | torch.Tensor],
) -> list[BlockWeights | torch.Tensor]:
    """Runs of adjacent block pieces of one format (bits, block, activations) stacked into
    one."""
    merged: list[BlockWeights | torch.Tensor] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            isinstance(piece, BlockWeights)
            and isinstance(last, BlockWeights)
            and (last.bits, last.block, last.activations)
            == (piece.bits, piece.block, piece.activations)
        ):
            merged[-1] = BlockWeights(
                torch.cat([last.q, piece.q]),
                torch.cat([last.scale, piece.scale]),
                torch.cat([last.offset, piece.offset]),
                piece.bits,
                piece.block,
                piece.activations,
            )
        else:
            merged.append(piece)
    return merged
