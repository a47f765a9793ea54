"""DraftManager with a stand-in draft model (DraftModelProposer): what it proposes under a
grammar, and that a failing draft model leaves every matcher where it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from grammar import GrammarSpec, create_backend
from radix_cache import KVSlotAllocator, RadixCache
from runtime.ipc import GenerateRequest
from runtime.model_config import ModelConfig
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.speculative.drafts import DRAFT_MODEL, DraftManager, SpeculationConfig
from runtime.speculative.verify import DraftVerifier


class _Worker:
    """Proposes by calling ``choose`` with logits favouring ``tokens`` in turn; raises after
    ``fail_after`` steps if given."""

    def __init__(self, vocab: int, tokens: list[int], fail_after: int | None = None) -> None:
        self.vocab, self.tokens, self.fail_after = vocab, tokens, fail_after
        self.released: list[str] = []

    def propose(self, jobs, choose):  # noqa: ANN001, ANN201
        drafts: list[list[int]] = [[] for _ in jobs]
        active = list(range(len(jobs)))
        for step in range(max(job.num_tokens for job in jobs)):
            if self.fail_after is not None and step == self.fail_after:
                raise RuntimeError("the draft model broke")
            logits = torch.full((len(active), self.vocab), -10.0)
            logits[:, self.tokens[step % len(self.tokens)]] = 10.0
            chosen = choose(logits, active, step)
            active = [i for i, t in zip(active, chosen, strict=True) if t >= 0]
            for i, t in zip(active, [t for t in chosen if t >= 0], strict=True):
                drafts[i].append(t)
            if not active:
                break
        return drafts

    def release(self, key: str, keep_in_cache: bool = True) -> None:
        self.released.append(key)


@pytest.fixture(scope="module")
def parts(tiny_model_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = ModelConfig.from_pretrained(tiny_model_path)
    backend = create_backend("xgrammar", tokenizer, config.vocab_size, config.eos_token_ids)
    return tokenizer, config, backend


def _manager(config: ModelConfig, worker: _Worker) -> DraftManager:
    verifier = DraftVerifier(Sampler(config.vocab_size, config.eos_token_ids))
    spec = SpeculationConfig(DRAFT_MODEL, num_draft_tokens=4, adaptive=False)
    return DraftManager(
        verifier, RadixCache(KVSlotAllocator(1024)), jump_forward=False, speculation=spec,
        draft_worker=worker,  # type: ignore[arg-type]
    )  # fmt: skip


def _req(backend, regex: str) -> Req:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_new_tokens=32)
    req = Req(GenerateRequest("r", [5, 6, 7], params), 0, speculates=True)
    req.constraint.matcher = backend.compile(GrammarSpec.for_regex(regex)).new_matcher()
    req.kv.kv_len = len(req.token_ids) - 1  # decoding: the last token waits for its KV
    return req


def _ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer.encode(text, add_special_tokens=False)


def test_model_drafts_stop_at_what_the_grammar_refuses(parts):
    tokenizer, config, backend = parts
    a, b, z = (_ids(tokenizer, c)[0] for c in "abz")
    manager = _manager(config, _Worker(config.vocab_size, [a, b, z, a]))
    req = _req(backend, "(ab)+")
    manager.propose([req])
    assert req.draft.tokens == [a, b]  # z is refused: drafting stops there
    assert req.draft.source == DRAFT_MODEL and req.draft.probs is None  # greedy: certain
    assert req.constraint.matcher.accept_token(a)  # the matcher stands where it stood


def test_a_failing_draft_model_leaves_the_matcher_where_it_was(parts):
    tokenizer, config, backend = parts
    a, b = (_ids(tokenizer, c)[0] for c in "ab")
    manager = _manager(config, _Worker(config.vocab_size, [a, b], fail_after=2))
    req = _req(backend, "abc")
    manager.propose([req])  # two tokens chosen (the matcher advanced), then the model broke
    assert req.draft.tokens == [] and not req.finished
    matcher = req.constraint.matcher
    assert matcher.accept_token(a) and matcher.accept_token(b)  # from the start
