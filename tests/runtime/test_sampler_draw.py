"""The sampler's draw: which rows are drawn, and the unfiltered fast path."""

from __future__ import annotations

from typing import Any

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels.reference.sampling import filter_probs

from runtime.ipc import GenerateRequest
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req

VOCAB = 32


def _req(i: int, **params: Any) -> Req:
    return Req(GenerateRequest(f"r{i}", [1, 2], SamplingParams(**params)), i)


def test_scoring_only_rows_are_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[int] = []
    real = kernels.sample_from_probs

    def counting(probs: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        drawn.append(probs.shape[0])
        return real(probs, *rest)

    monkeypatch.setattr(kernels, "sample_from_probs", counting)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = [
        _req(0, max_new_tokens=0, temperature=1.0),  # scores a prompt: its token is dropped
        _req(1, max_new_tokens=4, temperature=1.0, seed=7),
        _req(2, max_new_tokens=0, temperature=0.7, top_p=0.5),
    ]
    out = Sampler(VOCAB, [0]).sample(logits, reqs)
    assert drawn == [1]
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(
        logits[2].argmax()
    )
    # The sampled row draws what it draws alone.
    alone = Sampler(VOCAB, [0]).sample(
        logits[1:2], [_req(1, max_new_tokens=4, temperature=1.0, seed=7)]
    )
    assert out.token_ids[1] == alone.token_ids[0]


def test_unfiltered_rows_skip_the_sort() -> None:
    probs = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    off = (torch.full((4,), -1), torch.ones(4), torch.zeros(4))
    assert filter_probs(probs, *off) is probs
    assert (
        filter_probs(probs, torch.full((4,), VOCAB), torch.full((4,), 1.5), torch.zeros(4)) is probs
    )
    # One filtering row filters that row only; the others keep every token.
    top_k = torch.tensor([-1, 2, -1, -1])
    kept = filter_probs(probs, top_k, torch.ones(4), torch.zeros(4))
    assert int((kept[1] > 0).sum()) == 2
    assert torch.equal(kept[[0, 2, 3]], probs[[0, 2, 3]])
