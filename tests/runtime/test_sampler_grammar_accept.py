"""The sampler advances the batch's matchers in one call, and still redraws a refused token."""

from __future__ import annotations

from typing import Any

import torch

from runtime.ipc import GenerateRequest
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req

VOCAB = 16


class Matcher:
    """Accepts every token but ``refused``; records what it accepted."""

    def __init__(self, refused: int | None = None) -> None:
        self.refused = refused
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        if token == self.refused:
            return False
        self.accepted.append(token)
        return True


def _req(i: int, matcher: Matcher) -> Req:
    req = Req(GenerateRequest(f"r{i}", [1, 2], SamplingParams(max_new_tokens=4, temperature=0)), i)
    req.constraint.matcher = matcher
    return req


def test_one_batch_call_and_a_redraw_for_the_refused_row() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 3.0  # every row's argmax
    logits[:, 7] = 2.0  # the runner-up
    matchers = [Matcher(refused=5), Matcher(), Matcher()]
    calls: list[list[int]] = []

    def batch_accept(batch: list[Any], tokens: list[int]) -> list[bool]:
        calls.append(tokens)
        return [m.accept_token(t) for m, t in zip(batch, tokens, strict=True)]

    sampler = Sampler(VOCAB, [0])
    sampler.grammar_accept = batch_accept
    out = sampler.sample(logits, [_req(i, m) for i, m in enumerate(matchers)])
    assert calls == [[5, 5, 5]]
    assert out.token_ids == [7, 5, 5] and out.grammar_accepted == [True, True, True]
    assert [m.accepted for m in matchers] == [[7], [5], [5]]


def test_a_failing_batch_call_falls_back_to_one_by_one() -> None:
    def broken(batch: list[Any], tokens: list[int]) -> list[bool]:
        raise RuntimeError("boom")

    sampler = Sampler(VOCAB, [0])
    sampler.grammar_accept = broken
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1.0
    matchers = [Matcher(), Matcher()]
    out = sampler.sample(logits, [_req(i, m) for i, m in enumerate(matchers)])
    assert out.token_ids == [3, 3] and not out.failures
    assert [m.accepted for m in matchers] == [[3], [3]]
