"""Regression tests for the torch sampling reference, the oracle of the triton sampler."""

from __future__ import annotations

import torch
from arbor_kernels.reference import sampling as reference


def test_top_p_one_keeps_every_token() -> None:
    # A float32 cumsum over many tiny probabilities reaches the (differently rounded) total
    # before the last tokens; top_p = 1 is documented as off and must still keep them.
    probs = torch.softmax(torch.randn(4, 32000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    off = torch.zeros(4, dtype=torch.int64)
    kept = reference.filter_probs(probs, off, torch.ones(4), torch.zeros(4))
    assert torch.equal(kept, probs)


def test_top_p_keeps_the_smallest_prefix_reaching_it_with_ties() -> None:
    probs = torch.tensor([[0.25, 0.125, 0.125, 0.375, 0.125]])
    no_k, no_min_p = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    kept = reference.filter_probs(probs, no_k, torch.tensor([0.5]), no_min_p)
    assert (kept > 0).tolist() == [[True, False, False, True, False]]  # 0.375 + 0.25 >= 0.5
    kept = reference.filter_probs(probs, no_k, torch.tensor([0.7]), no_min_p)
    assert (kept > 0).tolist() == [[True, True, True, True, True]]  # the 0.125 tie stays whole
