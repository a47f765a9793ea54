"""Tensor-parallel layers: each rank holds a shard of the weight and sums or gathers partial
results over its group (``runtime.distributed.TPGroup``). With a group of one they are the
plain layers.

A Llama block uses them in pairs that need one all-reduce each: the column-parallel q|k|v
projection gives each rank its own heads, attention runs on them, and the row-parallel o_proj
sums the ranks' partial outputs; likewise gate|up (column) then down (row). The embedding
splits the vocabulary: a rank looks up the ids in its block, zeros for the rest, and the
all-reduce puts every row together. The LM head splits the vocabulary the same way and rank 0
gathers the blocks of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.distributed.group import TPGroup
from runtime.distributed.partition import Shard
from runtime.layers.basic import CheckpointTensor, Linear, fill, packed_linear, read_shard


class ColumnParallelLinear(Linear):
    """Output features split across ranks: ``pieces`` names, per stacked checkpoint tensor,
    the rows this rank holds. The output is this rank's slice of y, used as is by the next
    layer (attention over its heads, or a RowParallelLinear); nothing is communicated."""

    def __init__(
        self,
        in_features: int,
        pieces: Shard | dict[str, Shard],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, pieces, bias, dtype)


class RowParallelLinear(Linear):
    """Input features split evenly across the ranks of ``tp``: x is this rank's slice of the
    input (a ColumnParallelLinear's output), the partial products x W_r^T are summed over the
    ranks, and the (whole, replicated) bias is added once to the sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__(Shard.even(in_features, tp.rank, tp.size), out_features, bias, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        if self.packed is not None:
            partial = packed_linear(x, self.packed, None)
        else:
            partial = F.linear(x, self.weight)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding table split into equal blocks of vocabulary rows (the last one padded with
    zero rows): rank r holds ``shard``."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.dim = dim
        self.shard = Shard.padded(vocab_size, tp.rank, tp.size)
        self.weight = torch.nn.Parameter(torch.empty(self.shard.size, dim, dtype=dtype), False)

    def load(self, kind: str, piece: str, source: CheckpointTensor, name: str) -> None:
        """Fill this rank's rows from the whole checkpoint table ``source``."""
        assert kind == "weight" and piece == ""
        fill(self.weight.data, read_shard(source, name, (self.shard.full, self.dim), self.shard))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64 over the whole vocabulary. Returns [T, dim] on every rank."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.size)  # [T] rows another rank holds
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def gather_logits(tp: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rank 0: the logits over the whole vocabulary, [N, vocab_size], from every rank's block
    ``local`` [N, ceil(vocab_size / tp.size)]; other ranks: their own ``local`` block."""
    logits = tp.gather_to_leader(local)
    return logits[:, :vocab_size] if tp.is_leader else logits
