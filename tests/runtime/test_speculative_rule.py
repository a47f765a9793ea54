"""The speculative rule keeps the target's distribution: goodness of fit over many seeded
verifications, for certain drafts (lookup) and drafts drawn from a draft model's q."""

from __future__ import annotations

import pytest
import torch

from runtime.ipc import GenerateRequest
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.speculative.drafts import DRAFT_MODEL, NGRAM
from runtime.speculative.verify import DraftVerifier

V = 8
TRIALS = 5000


def _req(params: SamplingParams, seed: int, draft: list[int], q: torch.Tensor | None = None) -> Req:
    req = Req(GenerateRequest("r", [1, 2, 3], params), seed)
    req.draft.set(draft, NGRAM if q is None else DRAFT_MODEL, q)
    return req


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness of fit: the p-value of ``observed`` counts under ``expected_probs``
    (cells with no expected mass must be empty)."""
    total = float(observed.sum())
    keep = expected_probs > 0
    assert float(observed[~keep].sum()) == 0, "a token outside the target's support came out"
    expected = expected_probs[keep].double() * total
    statistic = float(((observed[keep].double() - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def _target(verifier: DraftVerifier, logits: torch.Tensor, req: Req) -> torch.Tensor:
    processed = verifier.process(logits.clone(), req, req.draft.tokens, 0, None)
    return verifier.probs(processed, req)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.95, min_p=0.02),
        SamplingParams(temperature=1.3, repetition_penalty=1.5, frequency_penalty=0.5),
    ],
    ids=["plain", "filtered", "penalties"],
)
@pytest.mark.parametrize("drafter", ["certain", "model"])
def test_verified_tokens_follow_the_target_distribution(params: SamplingParams, drafter: str):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 1.5  # rows for 2 draft tokens + the bonus
    q = torch.softmax(torch.randn(2, V, generator=gen), -1)  # the draft model's
    verifier = DraftVerifier(Sampler(V, eos_token_ids=[V - 1]))
    # Certain drafts: each row's second most likely token, accepted often but not always.
    certain = logits[:2].topk(2).indices[:, 1].tolist()
    first = torch.zeros(V)
    second = torch.zeros(V)  # given the first draft token was accepted
    lengths = torch.zeros(3)
    draw = torch.Generator().manual_seed(1)
    for seed in range(TRIALS):
        if drafter == "certain":
            req = _req(params, seed, certain)
        else:
            tokens = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
            req = _req(params, seed, tokens, q)
        verified = verifier.verify(req, logits, None)
        assert verified is not None
        tokens = verified.tokens
        lengths[len(tokens) - 1] += 1
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    req = _req(params, 0, certain if drafter == "certain" else [0, 0])
    p0 = _target(verifier, logits, req)[0]
    assert chi_square_p_value(first, p0) > 1e-3
    # The second token given the first was accepted: row 1 of the target (with penalties,
    # counting that token; a model draft's first token varies, so only certain drafts).
    if drafter == "certain":
        p1 = _target(verifier, logits, req)[1]
        assert chi_square_p_value(second, p1) > 1e-3
    assert lengths[1:].sum() > TRIALS * 0.05  # drafts were accepted, so both rows were tested


def test_greedy_accepts_while_the_argmax_agrees():
    verifier = DraftVerifier(Sampler(V, eos_token_ids=[V - 1]))
    logits = torch.full((3, V), -5.0)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = 5.0
    greedy = SamplingParams(temperature=0.0)
    for draft, kept in (([3, 5], [3, 5, 1]), ([3, 6], [3, 5]), ([2, 5], [3])):
        verified = verifier.verify(_req(greedy, 0, draft), logits, None)
        assert verified is not None and verified.tokens == kept
