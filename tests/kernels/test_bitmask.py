"""The triton bitmask kernel masks exactly what the torch reference masks, in place."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from arbor_kernels.reference import sampling as reference


def _random_case(
    batch: int, vocab: int, words: int, rows: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64)
    return logits, bitmask.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("vocab", "words"),
    [(64, 2), (77, 3), (100, 2), (45, 4)],  # exact, ragged last word, too few words, spare
)
def test_matches_reference_on_chosen_rows(
    triton_ops: ModuleType, dtype: torch.dtype, vocab: int, words: int
) -> None:
    logits, bitmask = _random_case(6, vocab, words, 3, dtype, seed=vocab)
    indices = torch.tensor([4, 0, 2])
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, indices)
    untouched = logits[[1, 3, 5]].clone()
    triton_ops.bitmask.apply_token_bitmask(logits, bitmask, indices, block_v=32)
    assert torch.equal(logits, expected)
    assert torch.equal(logits[[1, 3, 5]], untouched)


def test_without_indices_every_row_is_masked(triton_ops: ModuleType) -> None:
    logits, bitmask = _random_case(3, 70, 3, 3, torch.float32, seed=1)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, None)
    triton_ops.bitmask.apply_token_bitmask(logits, bitmask, None, block_v=64)
    assert torch.equal(logits, expected)


def test_known_bits(triton_ops: ModuleType) -> None:
    logits = torch.zeros(2, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # 0x80000001: tokens 0 and 31 (bit 31 is the sign bit)
    bitmask[0, 1] = 1 << 3  # token 35
    triton_ops.bitmask.apply_token_bitmask(logits, bitmask, torch.tensor([1]), block_v=32)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 31, 35]
    assert torch.equal(logits[0], torch.zeros(40))


def test_no_rows_is_a_no_op(triton_ops: ModuleType) -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    empty = torch.zeros(0, 2, dtype=torch.int32)
    triton_ops.bitmask.apply_token_bitmask(logits, empty, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)
