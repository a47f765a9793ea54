"""Constrained requests in the scheduler: the grammar queue, masks each step, and drafts.

A request with a constraint or stop regexes waits in the grammar queue while they are prepared
in the compile sandbox's worker processes (built, analysed and trial-compiled under a hard
deadline) and then compiled on the grammar service's threads; other requests keep running.
Each loop iteration polls the queue; a ready request joins the waiting queue with a fresh
matcher (held by a ``ReasoningGate`` while a reasoning model thinks) and stop-regex matcher.
An invalid constraint, an overrun of the deadline or a crashed worker fails that request alone
with a 400. Each step, the masks of the constrained rows are filled into one packed int32
bitmask and applied to the batch's logits in one op.

The fill only needs each matcher's state, which the previous step's tokens fixed, so the
overlap scheduler fills the masks (``prepare_masks``) while the forward runs; applying them
after the forward is then one pass over the logits.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grammar import (
    CompileHandle,
    CompileSandbox,
    GrammarError,
    GrammarMatcher,
    GrammarService,
    Prepared,
    StopRegex,
    allocate_bitmask,
    allow_token,
    apply_filled_masks,
    create_backend,
)
from runtime.histogram import Histogram
from runtime.incremental_decoder import IncrementalDecoder
from runtime.sampling_params import GRAMMAR_FIELDS, SamplingParams
from runtime.scheduler.reasoning_gate import ReasoningGate, reasoning_gate
from runtime.scheduler.stop_checker import PROMPT_TAIL
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.scheduler.req import Req

logger = logging.getLogger(__name__)

_OPTION_FIELDS = ("grammar_best_effort", "grammar_max_whitespace", "json_format")

# On CPU, masks are filled while the forward runs only when a step's fill takes this long on
# average (measured, small model at batch 16: a 0.2 ms fill of fixed keys beside the forward
# cost more than it hid; 5-25 ms fills inside free-text strings hide 15% of the step).
OVERLAP_FILL_MIN_MS = 1.0
_FILL_EMA = 0.2  # weight of the newest fill in the moving average
# Upper bounds (seconds) of the /metrics histogram of grammar compile times.
COMPILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def needs_preparing(params: SamplingParams) -> bool:
    """Whether a request has a constraint or stop regexes (so it waits in the grammar queue)."""
    return params.has_grammar or bool(params.stop_regex)


def _identity(
    reqs: Sequence[Req], sources: Sequence[tuple[Any, int | None] | None]
) -> tuple[tuple[int, int, int | None], ...]:
    return tuple(
        (id(r), id(s[0]) if s else 0, s[1] if s else None)
        for r, s in zip(reqs, sources, strict=True)
    )


def constraint_request(params: SamplingParams) -> dict[str, Any]:
    """The sampling params the sandbox prepares, as JSON-like values (its cache key)."""
    request: dict[str, Any] = {}
    for name in GRAMMAR_FIELDS:
        value = getattr(params, name)
        if value not in (None, False, (), ""):
            request[name] = list(value) if isinstance(value, tuple) else value
    if request:
        request.update({name: getattr(params, name) for name in _OPTION_FIELDS})
    if params.stop_regex:
        request["stop_regex"] = list(params.stop_regex)
    return request


class PrefixRefused(ValueError):
    """The constraint refuses the prefilled answer it was to continue (a 400)."""


@dataclass
class PendingConstraint:
    """A queued request's progress: preparing in the sandbox, then compiling here."""

    prepare: Future[Prepared]
    compile: CompileHandle | None = None
    since: float = field(default_factory=time.monotonic)  # when it joined the grammar queue
    cached: bool = False  # the compile cache held its grammar


@dataclass
class ConstraintState:
    """A request's constraint and stop regexes: set by the GrammarManager while the request
    waits in its queue, then moved on only through ``advance``."""

    matcher: GrammarMatcher | None = None  # constrains the next token (None: free)
    gate: ReasoningGate | None = None  # holds the matcher while the model reasons
    pending: PendingConstraint | None = None  # preparing or compiling
    stop_regex: StopRegex | None = None
    stop_text: IncrementalDecoder | None = None  # the output's text the stop regexes read
    notes: tuple[str, ...] = ()  # how the constraint was applied (LoweredGrammar.notes)

    @property
    def mask_source(self) -> tuple[Any, int | None] | None:
        """What the next token's mask is filled from: (matcher, a token allowed besides the
        grammar's), or None (unmasked). While its reasoning gate is opening, the held
        matcher's mask plus the token that opens the reasoning."""
        gate = self.gate
        if self.matcher is not None:
            return self.matcher, None
        return (gate.matcher, gate.start_token) if gate is not None and gate.opening else None

    @property
    def masks_next_token(self) -> bool:
        """Whether ``mask_source`` is not None (asked per row each step: builds no tuple)."""
        return self.matcher is not None or (self.gate is not None and self.gate.opening)

    def advance(self, token: int, matcher_advanced: bool) -> bool:
        """Take the request's new output token (``matcher_advanced``: the matcher has taken
        it already); False if the grammar refuses it. The constraint applies once a reasoning
        gate opens."""
        gate = self.gate
        if gate is not None:
            if gate.advance(token):
                self.matcher, self.gate = gate.matcher, None
            return True
        return matcher_advanced or self.matcher is None or self.matcher.accept_token(token)


class GrammarManager:
    def __init__(
        self, args: ServerArgs, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        backend = create_backend(args.grammar_backend, tokenizer, vocab_size, stop_token_ids)
        self.backend = backend
        self.service = GrammarService(backend, compile_timeout=args.grammar_compile_timeout)
        self.sandbox = CompileSandbox(
            (args.grammar_backend, tokenizer, vocab_size, tuple(stop_token_ids)),
            workers=args.grammar_workers,
            timeout=args.grammar_compile_timeout,
        )
        self.vocab_size = vocab_size
        self.queue: list[Req] = []
        self._bitmask = allocate_bitmask(8, vocab_size)
        # Masks filled ahead by prepare_masks: the (request, matcher, extra token) identities
        # they belong to, and the filled rows of _bitmask.
        self._prepared: tuple[tuple[int, int, int | None], ...] | None = None
        self.fill_ms = 0.0  # moving average of one step's mask fill (see prepare_masks)
        self._blank_tokens: dict[int, bool] = {}
        # Seconds each constraint the compile cache did not hold took, from the grammar queue
        # to its matcher (the sandbox's preparation and the compile): /metrics.
        self.compile_seconds = Histogram(COMPILE_BUCKETS)

    def enqueue(self, req: Req) -> None:
        """Start preparing ``req``'s constraint and stop regexes (see ``needs_preparing``)."""
        req.constraint.pending = PendingConstraint(
            self.sandbox.submit(constraint_request(req.sampling))
        )
        self.queue.append(req)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests ready to run, requests failed), removed from the queue; never blocks."""
        ready: list[Req] = []
        failed: list[Req] = []
        for req in self.queue:
            try:
                done = self._advance(req)
            except PrefixRefused as exc:
                req.fail(400, str(exc), "grammar_prefix_len")
                failed.append(req)
                continue
            except GrammarError as exc:  # the constraint's, or else the stop regexes' fault
                req.fail(400, str(exc), req.sampling.grammar_field or "stop_regex")
                failed.append(req)
                continue
            except Exception as exc:
                req.fail_from(exc, "compiling the constraint of")
                failed.append(req)
                continue
            if done:
                req.constraint.pending = None
                ready.append(req)
        if ready or failed:
            done_ids = {id(r) for r in ready + failed}
            self.queue = [r for r in self.queue if id(r) not in done_ids]
        return ready, failed

    def _advance(self, req: Req) -> bool:
        """Move ``req`` on as far as it can go now; True once it can run."""
        state = req.constraint
        pending = state.pending
        assert pending is not None, "only queued requests advance"
        if pending.compile is None:
            if not pending.prepare.done():
                return False
            prepared = pending.prepare.result()  # GrammarError if it failed
            if prepared.stop_regex is not None:
                state.stop_regex = pickle.loads(prepared.stop_regex)  # a fresh copy per request
                state.stop_text = IncrementalDecoder(
                    self.backend.tokenizer, req.input_ids[-PROMPT_TAIL:],
                    req.sampling.skip_special_tokens, True,
                )  # fmt: skip
            if prepared.lowered is None:
                return True
            state.notes = prepared.lowered.notes
            pending.compile = self.service.submit_lowered(prepared.lowered)
            pending.cached = pending.compile.result is not None
        compiled = self.service.poll(pending.compile)
        if compiled is None:
            return False
        if not pending.cached:
            self.compile_seconds.observe(time.monotonic() - pending.since)
        matcher = compiled.new_matcher()
        self._take_prefix(req, matcher)
        state.gate = reasoning_gate(req.sampling, req.input_ids, matcher, self._blank)
        if state.gate is None:
            state.matcher = matcher
        return True

    def _take_prefix(self, req: Req, matcher: GrammarMatcher) -> None:
        """Feed ``matcher`` the prompt's last ``grammar_prefix_len`` tokens (a prefilled
        answer); PrefixRefused when the constraint cannot continue them."""
        count = req.sampling.grammar_prefix_len
        prompt = req.input_ids
        if count > len(prompt):
            raise PrefixRefused(
                f"grammar_prefix_len: {count} is longer than the prompt ({len(prompt)} tokens)"
            )
        prefix = list(prompt[len(prompt) - count :])
        for i, token in enumerate(prefix):
            if not matcher.accept_token(token):
                decode = self.backend.tokenizer.decode
                raise PrefixRefused(
                    f"the constraint cannot continue the prefilled answer "
                    f"{decode(prefix)!r}: it refuses {decode(prefix[: i + 1])!r}"
                )

    def _blank(self, token: int) -> bool:
        """Whether ``token`` decodes to whitespace alone (remembered per token)."""
        blank = self._blank_tokens.get(token)
        if blank is None:
            text = self.backend.tokenizer.decode([token])
            blank = self._blank_tokens[token] = bool(text) and text.isspace()
        return blank

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

    def prepare_masks(self, reqs: Sequence[Req], device: torch.device) -> None:
        """Fill the masks of ``reqs``' constrained rows now, for the next ``apply_masks`` with
        the same requests (the matchers must not move in between).

        On CPU the forward already keeps every core busy, so a fill beside it slows the forward
        down: it is done ahead only while the recent fills took at least OVERLAP_FILL_MIN_MS
        (free-text strings, long bounded repetitions), and after the forward otherwise."""
        self._prepared = None
        sources = [req.constraint.mask_source for req in reqs]
        present = [s for s in sources if s is not None]
        if not present or (device.type == "cpu" and self.fill_ms < OVERLAP_FILL_MIN_MS):
            return
        self._fill(present)
        self._prepared = _identity(reqs, sources)

    def apply_masks(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        """Mask row i of ``logits`` [N, V] with reqs[i]'s grammar where it has one (in place;
        see ``ConstraintState.mask_source``). Uses the masks ``prepare_masks`` filled for
        these requests, else fills them now."""
        sources = [req.constraint.mask_source for req in reqs]
        rows = [i for i, s in enumerate(sources) if s is not None]
        prepared, self._prepared = self._prepared, None
        if not rows:
            return
        if prepared is None or prepared != _identity(reqs, sources):
            self._fill([s for s in sources if s is not None])
        apply_filled_masks(logits, self._bitmask, rows)

    def _fill(self, sources: list[tuple[Any, int | None]]) -> None:
        """Fill rows 0.. of the shared bitmask, one per (matcher, extra allowed token); keep
        the fill time's average."""
        start = time.perf_counter()
        bitmask = self.bitmask(len(sources))
        self.backend.fill_masks([m for m, _ in sources], bitmask, list(range(len(sources))))
        for row, (_, token) in enumerate(sources):
            if token is not None:
                allow_token(bitmask, row, token)
        elapsed = (time.perf_counter() - start) * 1e3
        self.fill_ms += _FILL_EMA * (elapsed - self.fill_ms)

    def shutdown(self) -> None:
        self.sandbox.shutdown()
        self.service.shutdown()
