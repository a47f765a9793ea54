"""A small constrained-decoding loop over the tiny model, standing in for the scheduler.

Batched decode with one packed bitmask per step applied in one ``kernels.apply_token_bitmask``
call to the constrained rows only; sampling at temperature T with a generator per sequence
(greedy at T = 0); tokens accepted after sampling; a sequence ends when its matcher
terminates (unconstrained: on EOS) or at max_tokens. ``generate_jump_forward`` runs one
sequence with grammar drafts verified in one extend step, as the scheduler will.

A random-weight model rarely chooses to close a string or end a number, so ``generate`` can add
a logit bias (before masking, like a request's logit_bias) to tokens that contain a closing
quote or bracket and to stop tokens. The mask still decides what is allowed, so validity is
tested all the same; the bias only makes outputs finish within the token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import arbor_kernels as kernels
import torch

from grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    allocate_bitmask,
    apply_grammar_masks,
    commit_draft,
    fill_draft_masks,
    verify_draft,
)
from runtime.model_runner import ModelRunner

PROMPT = "Reply in the requested format:"


@dataclass
class Generated:
    token_ids: list[int]  # without the final stop token
    text: str
    terminated: bool  # the grammar (or EOS) ended it, not max_tokens
    forward_steps: int


class ConstrainedDecoder:
    def __init__(self, runner: ModelRunner, tokenizer: Any, backend: GrammarBackend) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.backend = backend
        self.vocab_size = runner.config.vocab_size
        self.stop_ids = set(runner.config.eos_token_ids)
        self.prompt = tokenizer.encode(PROMPT)
        self.closing = torch.zeros(self.vocab_size)  # [V]: 1 for closing and stop tokens
        for token in range(len(tokenizer)):
            if any(c in tokenizer.decode([token]) for c in '"]}'):
                self.closing[token] = 1.0
        self.closing[list(self.stop_ids)] = 1.0
        pool = runner.req_to_token_pool
        self.capacity = runner.kv_slots // runner.max_requests
        for row in range(runner.max_requests):  # row r owns a fixed block of KV slots
            pool.write(row, 0, torch.arange(row * self.capacity, (row + 1) * self.capacity))

    def generate(
        self,
        grammars: Sequence[CompiledGrammar | None],
        seeds: Sequence[int],
        max_tokens: int,
        temperature: float = 1.0,
        closing_bias: float = 0.0,
    ) -> list[Generated]:
        """One batch, one sequence per (grammar or None, seed)."""
        pool = self.runner.req_to_token_pool
        rows = [self._alloc() for _ in grammars]
        lens = [len(self.prompt)] * len(rows)
        matchers = [g.new_matcher() if g is not None else None for g in grammars]
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        outputs: list[list[int]] = [[] for _ in rows]
        finished: list[bool] = [False] * len(rows)
        logits = self._forward(rows, [0] * len(rows), [self.prompt] * len(rows))
        steps, active = 1, list(range(len(rows)))
        try:
            while True:
                logits += closing_bias * self.closing
                self.apply_masks(logits, [matchers[i] for i in active])
                tokens = _sample(logits, [generators[i] for i in active], temperature)
                still = []
                for i, token in zip(active, tokens, strict=True):
                    outputs[i].append(token)
                    matcher = matchers[i]
                    if matcher is not None:
                        assert matcher.accept_token(token), "sampled a token the mask forbids"
                        finished[i] = matcher.is_terminated()
                    else:
                        finished[i] = token in self.stop_ids
                    if not finished[i] and len(outputs[i]) < max_tokens:
                        still.append(i)
                active = still
                if not active:
                    break
                logits = self._forward(
                    [rows[i] for i in active],
                    [lens[i] + len(outputs[i]) - 1 for i in active],
                    [[outputs[i][-1]] for i in active],
                )
                steps += 1
        finally:
            for row in rows:
                pool.free(row)
        return [self._result(out, done, steps) for out, done in zip(outputs, finished, strict=True)]

    def apply_masks(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        """Mask the constrained rows of logits [B, V] in one op; other rows stay untouched."""
        apply_grammar_masks(self.backend, logits, matchers)

    def generate_jump_forward(
        self,
        grammar: CompiledGrammar,
        max_tokens: int,
        jump_forward: bool,
        temperature: float = 0.0,
        seed: int = 0,
        max_draft: int = 16,
    ) -> Generated:
        """One sequence; with jump_forward, forced text is drafted and verified in one step."""
        pool = self.runner.req_to_token_pool
        row = self._alloc()
        matcher = grammar.new_matcher()
        generator = torch.Generator().manual_seed(seed)
        kv_len = len(self.prompt)
        logits = self._forward([row], [0], [self.prompt])
        steps = 1
        out: list[int] = []
        try:
            while True:
                self.apply_masks(logits, [matcher])
                out.append(_sample(logits, [generator], temperature)[0])
                assert matcher.accept_token(out[-1])
                budget = min(max_draft, max_tokens - len(out) - 1)
                draft = matcher.jump_forward_tokens(budget) if jump_forward else []
                while draft and not matcher.is_terminated():
                    bitmask = allocate_bitmask(len(draft) + 1, self.vocab_size)
                    fill_draft_masks(matcher, draft, bitmask, 0)
                    verify = self._forward([row], [kv_len], [[out[-1], *draft]], "all")
                    steps += 1
                    kernels.apply_token_bitmask(verify, bitmask)
                    scores = verify if temperature == 0 else torch.softmax(verify / temperature, -1)
                    verdict = verify_draft(
                        draft,
                        scores,
                        temperature == 0,
                        lambda: float(torch.rand((), generator=generator)),
                    )
                    assert commit_draft(matcher, draft, verdict)
                    kv_len += 1 + verdict.accepted
                    out += [*draft[: verdict.accepted], verdict.next_token]
                    budget = min(max_draft, max_tokens - len(out) - 1)
                    draft = matcher.jump_forward_tokens(budget)
                if matcher.is_terminated() or len(out) >= max_tokens:
                    break
                logits = self._forward([row], [kv_len], [[out[-1]]])
                kv_len += 1
                steps += 1
        finally:
            pool.free(row)
        return self._result(out, matcher.is_terminated(), steps)

    def _alloc(self) -> int:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None, "out of request rows"
        return row

    def _forward(
        self, rows: list[int], prefix_lens: list[int], ids: list[list[int]], logits: str = "last"
    ) -> torch.Tensor:
        batch = self.runner.build_batch(rows, prefix_lens, ids, logits=logits)
        return self.runner.forward(batch).float().clone()  # a normal tensor, maskable in place

    def _result(self, out: list[int], terminated: bool, steps: int) -> Generated:
        tokens = out[:-1] if out and out[-1] in self.stop_ids else out
        return Generated(tokens, self.tokenizer.decode(tokens), terminated, steps)


def _sample(
    logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float
) -> list[int]:
    if temperature == 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits / temperature, dim=-1)
    return [
        int(torch.multinomial(row, 1, generator=g))
        for row, g in zip(probs, generators, strict=True)
    ]


def sample_random(
    grammar: CompiledGrammar,
    vocab_size: int,
    seed: int,
    max_tokens: int,
    bias: torch.Tensor | None = None,
) -> tuple[list[int], bool]:
    """Tokens sampled under the grammar from seeded random logits (plus ``bias`` [V]), and
    whether the grammar terminated; a model-free way to explore a grammar's outputs quickly."""
    matcher = grammar.new_matcher()
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    out: list[int] = []
    while len(out) < max_tokens and not matcher.is_terminated():
        logits = torch.randn(1, vocab_size, generator=generator)
        if bias is not None:
            logits += bias
        matcher.fill_mask(bitmask, 0)
        kernels.apply_token_bitmask(logits, bitmask)
        out.append(_sample(logits, [generator], 1.0)[0])
        assert matcher.accept_token(out[-1])
    return out, matcher.is_terminated()
