"""Constrained requests in the scheduler: the grammar queue, masks each step, and drafts.

A constrained request waits in the grammar queue while its grammar compiles on the grammar
service's threads (other requests keep running); each loop iteration polls it, and once
compiled it joins the waiting queue with a fresh matcher. A compile error or timeout fails
that request alone with a 400. Each step, the masks of the constrained rows are filled into
one packed int32 bitmask and applied to the batch's logits in one op.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grammar import (
    GrammarError,
    GrammarService,
    GrammarSpec,
    allocate_bitmask,
    apply_grammar_masks,
    create_backend,
)
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The request's constraint, validated; GrammarError (a ValueError) names what is wrong.

    ``structural_tag`` holding ``{"tools": [...], "mode": "required"|"named", "name": ...}`` is
    the tool-call form the OpenAI layer sends for tool_choice required/named; any other
    structural_tag is passed to the backend as is.
    """
    tag = params.structural_tag
    if isinstance(tag, Mapping) and "tools" in tag and "mode" in tag:
        options = GrammarSpec.from_sampling_params({"json_object": True, **_options(params)})
        assert options is not None
        return GrammarSpec.for_tool_calls(
            tag["tools"],
            tag["mode"],
            tag.get("name"),
            bool(tag.get("parallel", True)),
            options.options,
        )
    return GrammarSpec.from_sampling_params(params)


def _options(params: SamplingParams) -> dict[str, Any]:
    return {
        "grammar_best_effort": params.grammar_best_effort,
        "grammar_max_whitespace": params.grammar_max_whitespace,
    }


class GrammarManager:
    def __init__(
        self, args: ServerArgs, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        backend = create_backend(args.grammar_backend, tokenizer, vocab_size, stop_token_ids)
        self.backend = backend
        self.service = GrammarService(backend, compile_timeout=args.grammar_compile_timeout)
        self.vocab_size = vocab_size
        self.queue: list[Req] = []
        self._bitmask = allocate_bitmask(8, vocab_size)

    def enqueue(self, req: Req, spec: GrammarSpec) -> None:
        req.grammar_pending = self.service.submit(spec)
        self.queue.append(req)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests whose grammar is ready, requests failed with a 400), removed from the queue."""
        ready: list[Req] = []
        failed: list[Req] = []
        for req in self.queue:
            try:
                compiled = self.service.poll(req.grammar_pending)
            except GrammarError as exc:
                req.finish({"type": "abort", "status_code": 400, "message": str(exc)})
                failed.append(req)
                continue
            if compiled is not None:
                req.grammar = compiled.new_matcher()
                req.grammar_pending = None
                ready.append(req)
        if ready or failed:
            done = {id(r) for r in ready + failed}
            self.queue = [r for r in self.queue if id(r) not in done]
        return ready, failed

    def remove(self, rid: str) -> Req | None:
        for req in self.queue:
            if req.rid == rid:
                self.queue.remove(req)
                return req
        return None

    def bitmask(self, rows: int) -> torch.Tensor:
        """A reusable CPU bitmask buffer with at least ``rows`` rows (fills overwrite rows)."""
        if self._bitmask.shape[0] < rows:
            self._bitmask = allocate_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        return self._bitmask[:rows]

    def apply_masks(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        """Mask row i of ``logits`` [N, V] with reqs[i]'s grammar where it has one (in place)."""
        matchers = [r.grammar for r in reqs]
        constrained = sum(m is not None for m in matchers)
        if constrained:
            apply_grammar_masks(self.backend, logits, matchers, self.bitmask(constrained))

    def shutdown(self) -> None:
        self.service.shutdown()
