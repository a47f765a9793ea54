"""Which part of each weight a tensor-parallel rank holds (pure arithmetic, no torch).

Attention heads split evenly across ranks. KV heads split too when there are at least as many
as ranks; with fewer, each rank holds the one KV head its query heads read (replicated on
``tp_size / num_kv_heads`` ranks). The MLP's intermediate dimension splits evenly; the
vocabulary splits into equal blocks of ``ceil(vocab / tp_size)`` rows, the last block padded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Indices [start, start + size) of a checkpoint dimension of length ``full``. A shard may
    run past ``full`` (a padded vocabulary block): the rows beyond it are zeros."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, full: int) -> Shard:
        return cls(full, 0, full)

    @classmethod
    def even(cls, full: int, rank: int, tp_size: int) -> Shard:
        """Rank ``rank``'s block of ``full`` split into ``tp_size`` equal blocks (``full`` must
        divide evenly: see ``check_tp_size``)."""
        size = full // tp_size
        return cls(full, rank * size, size)

    @classmethod
    def padded(cls, full: int, rank: int, tp_size: int) -> Shard:
        """Rank ``rank``'s block of ``ceil(full / tp_size)`` indices (the vocabulary's split)."""
        size = -(-full // tp_size)
        return cls(full, rank * size, size)

    @property
    def stored(self) -> int:
        """How many of the shard's indices exist in the checkpoint (the rest are padding)."""
        return max(0, min(self.size, self.full - self.start))


@dataclass(frozen=True)
class HeadPartition:
    """The attention heads of one rank: query heads [q_start, q_start + num_heads) and KV
    heads [kv_start, kv_start + num_kv_heads) of the model's. Query head h reads KV head
    h // (total heads / total KV heads), so a rank's query heads read only its KV heads."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of_rank(cls, num_heads: int, num_kv_heads: int, rank: int, tp_size: int) -> HeadPartition:
        heads = num_heads // tp_size
        if num_kv_heads >= tp_size:
            kv_heads = num_kv_heads // tp_size
            return cls(heads, kv_heads, rank * heads, rank * kv_heads)
        ranks_per_kv_head = tp_size // num_kv_heads
        return cls(heads, 1, rank * heads, rank // ranks_per_kv_head)


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise ValueError naming the model's head counts unless ``tp_size`` ranks can split it:
    ``tp_size`` must divide the attention heads and the MLP's intermediate size, and divide
    or be a multiple of the KV heads."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    valid = [
        n
        for n in range(1, num_heads + 1)
        if num_heads % n == 0
        and intermediate_size % n == 0
        and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]
    if tp_size not in valid:
        raise ValueError(
            f"tp_size {tp_size} cannot split this model (num_attention_heads={num_heads}, "
            f"num_key_value_heads={num_kv_heads}, intermediate_size={intermediate_size}): "
            "it must divide the attention heads and the intermediate size, and divide or be a "
            f"multiple of the KV heads; this model takes tp_size {', '.join(map(str, valid))}"
        )
