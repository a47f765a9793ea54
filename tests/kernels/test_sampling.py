"""The triton sampler keeps exactly the reference's token set, draws from it in proportion,
and gives a row the same token for the same (seed, offset) whatever else is in the batch."""

from __future__ import annotations

import itertools
from types import ModuleType

import torch
from arbor_kernels.reference import sampling as reference

TOP_K = [0, 1, 3, 7, 40, 50]
TOP_P = [0.0, 0.3, 0.5, 0.9, 1.0]
MIN_P = [0.0, 0.05, 0.5]


def _dyadic_rows(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of multiples of 1/512 summing to exactly 1, with many ties: every partial sum and
    product with top_p is exact in float32, so the kept set has one right answer."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 12, (batch, vocab), generator=gen)
    counts[:, -1] = 0
    counts[:, -1] = 512 - counts.sum(-1)
    return (counts[:, torch.randperm(vocab, generator=gen)] / 512).float()


def _kept(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return (probs >= threshold[:, None]) & (probs > 0)


def _filters(rows: list[tuple[int, float, float]]) -> tuple[torch.Tensor, ...]:
    top_k, top_p, min_p = zip(*rows, strict=True)
    return torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p)


def test_keeps_the_reference_set_on_exact_rows(triton_ops: ModuleType) -> None:
    combos = [(k, p, m) for k, p, m in itertools.product(TOP_K, TOP_P, MIN_P) if (k + m) < 45]
    combos = combos[::3]  # every filter value, many combinations, a few seconds interpreted
    probs = _dyadic_rows(len(combos), 40, seed=0)
    top_k, top_p, min_p = _filters(combos)
    threshold = triton_ops.sampling.keep_thresholds(probs, top_k, top_p, min_p, block_v=16)
    expected = reference.filter_probs(probs, top_k, top_p, min_p) > 0
    mismatched = (_kept(probs, threshold) != expected).any(-1)
    assert not mismatched.any(), [combos[i] for i in mismatched.nonzero().flatten().tolist()]


def test_keeps_the_reference_set_on_softmax_rows(triton_ops: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    combos = [(0, 1.0, 0.0), (20, 1.0, 0.0), (0, 0.8, 0.0), (50, 0.95, 0.0), (0, 1.0, 0.02)]
    logits = torch.randn(len(combos), 300, generator=gen) * 2.5
    probs = torch.softmax(logits, -1)
    top_k, top_p, min_p = _filters(combos)
    threshold = triton_ops.sampling.keep_thresholds(probs, top_k, top_p, min_p, block_v=64)
    expected = reference.filter_probs(probs, top_k, top_p, min_p) > 0
    assert torch.equal(_kept(probs, threshold), expected)
    assert expected.sum(-1)[0] == 300 and expected.sum(-1)[1] == 20


def test_draws_are_kept_and_independent_of_the_batch(triton_ops: ModuleType) -> None:
    combos = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.3), (9, 0.8, 0.1)]
    probs = _dyadic_rows(len(combos), 40, seed=2)
    top_k, top_p, min_p = _filters(combos)
    seeds = torch.tensor([11, 11, -3, 2**40, 7])
    offsets = torch.tensor([0, 1, 5, 2**33, 3])
    sample = triton_ops.sampling.sample_from_probs
    tokens = sample(probs, top_k, top_p, min_p, seeds, offsets, block_v=16)
    kept = reference.filter_probs(probs, top_k, top_p, min_p) > 0
    assert kept[torch.arange(len(combos)), tokens].all()

    # The same rows in reverse order, beside rows that were not there before.
    other = _dyadic_rows(2, 40, seed=3)
    order = torch.arange(len(combos) - 1, -1, -1)
    mixed = [
        torch.cat([probs[order], other]),
        torch.cat([top_k[order], torch.tensor([0, 4])]),
        torch.cat([top_p[order], torch.tensor([1.0, 0.5])]),
        torch.cat([min_p[order], torch.tensor([0.0, 0.0])]),
        torch.cat([seeds[order], torch.tensor([1, 2])]),
        torch.cat([offsets[order], torch.tensor([0, 0])]),
    ]
    again = sample(*mixed, block_v=16)
    assert torch.equal(again[: len(combos)], tokens[order])


def test_top_k_1_is_greedy(triton_ops: ModuleType) -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(4)), -1)
    ones = torch.ones(3, dtype=torch.int64)
    tokens = triton_ops.sampling.sample_from_probs(
        probs, ones, torch.ones(3), torch.zeros(3), torch.arange(3), torch.arange(3)
    )
    assert torch.equal(tokens, probs.argmax(-1))


def test_draws_follow_the_filtered_distribution(triton_ops: ModuleType) -> None:
    probs = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.18, 0.12])
    draws = 500
    rows = probs.expand(draws, -1).contiguous()
    min_p = torch.full((draws,), 0.5)  # keeps 0.30, 0.25, 0.18: a quarter of the mass goes
    tokens = triton_ops.sampling.sample_from_probs(
        rows,
        torch.zeros(draws, dtype=torch.int64),
        torch.ones(draws),
        min_p,
        torch.full((draws,), 1234),
        torch.arange(draws),
    )
    expected = reference.filter_probs(probs[None], torch.zeros(1), torch.ones(1), min_p[:1])[0]
    kept = expected > 0
    assert kept.tolist() == [True, False, True, False, True, False]
    expected = expected / expected.sum() * draws
    observed = torch.bincount(tokens, minlength=6).float()
    assert (observed[~kept] == 0).all()
    chi_square = float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi_square < 13.82, (observed, expected)  # 2 degrees of freedom, p = 0.001
