"""Runs compiled DSL programs next to the KV cache, on the tokenizer manager's event loop.

A program is a set of branches (the root state ``""`` and its fork branches), each a token
sequence that only grows. Text a program appends is kept as text until a ``gen`` or ``select``
needs it, then tokenized once, at the boundary: the last few tokens of the branch are decoded
and re-encoded together with the new text (token healing), so the new text tokenizes as it
would in the whole prompt, and only those tokens are re-encoded. Generated tokens are kept as
the model produced them (never re-tokenized), except what a stop string or EOS cut from the
text.

Each step is a request to the scheduler that continues the branch's pinned KV
(``ProgramStep``): admitted from the pinned node, its result pinned in turn. Fork branches
start from their parent's pin, so they share its slots; ``select`` scores every choice on the
live KV in one batch. A session (a program's branches, their tokens and pins) lives across the
program's segments (its Python code runs between them) until the program ends, or is idle for
the pin timeout.

A request without ``program_id`` starts a new program (the id is the runtime's, in its
``ProgramStarted`` event); one with ``program_id`` continues that program and only that: an id the
runner does not hold is refused (``ProgramGone``: 404, or 410 with why it ended when it ended
recently), never started afresh, so no continuation runs without the context it was written for.

Results go out as events (``runtime/program/events.py``), in order per branch. A failed op stops its
branch (later ops of that branch are skipped, as the interpreter's branch stops at its first error);
the other branches go on.

A program belongs to its tenant: the caller (the key it authenticated with, ``""`` in-process)
and the cache salt of its first segment (every request it makes carries it). Ids are looked up
per tenant, so another tenant's continuation or ``end`` finds nothing, exactly as for an id that
never existed. Each tenant holds at most ``max_per_tenant`` programs: its new one ends its own
longest idle one ("evicted"), not another tenant's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.errors import RequestError, SchedulerDied
from runtime.ipc import ProgramRelease, ProgramStep
from runtime.program.events import (
    GenDelta,
    GenDone,
    OpFailed,
    ProgramDone,
    ProgramEvent,
    ProgramStarted,
    ProgramStats,
    SelectDone,
)
from runtime.program.select_math import (
    HEAL_WINDOW,
    UNCONDITIONAL_LIKELIHOOD_NORMALIZED,
    heal_boundary,
    pick,
)
from runtime.program.spec import (
    ForkOp,
    GenOp,
    InvalidGen,
    JoinOp,
    Op,
    ProgramRequest,
    SelectOp,
    TextOp,
    branch_key,
    check_joins,
)
from runtime.sampling_params import SamplingParams
from runtime.tokenizer_manager import final_output

if TYPE_CHECKING:
    from runtime.tokenizer_manager import RequestOutput
    from runtime.validate_retry import ValidatedGeneration

logger = logging.getLogger(__name__)

# Tokens decoded and re-encoded with new text at a boundary (token healing).
BOUNDARY_TOKENS = 4
# Most sessions kept at once; beyond, the longest idle of all is ended ("evicted").
MAX_SESSIONS = 4096
# Ended programs remembered (with why) so that a late continuation is told why it cannot go on.
RECENTLY_ENDED = 4096
# Why a program ended, as a refused continuation reports it.
ENDED_BECAUSE = {
    "ended": "ended (its last segment had end: true)",
    "deleted": "was deleted (DELETE /program/{id})",
    "expired": "expired (idle longer than the pin timeout, --program-pin-timeout-s)",
    "evicted": "was evicted (its tenant, or the server, started more programs than it keeps)",
    "abandoned": "was abandoned (a segment stopped unfinished: its client went away, or it failed)",
}
SCORE_ONLY = SamplingParams(max_new_tokens=0)

Emit = Callable[[ProgramEvent], Awaitable[None]]
# (caller, cache salt, program id): a program is known only to the tenant that started it.
SessionKey = tuple[str, str | None, str]


class ProgramGone(RequestError):
    """A continuation (or end) names a program this tenant does not hold: 404 when the runner
    never held it for this tenant (or forgot it), 410 when it ended recently, ``reason`` saying
    why (a key of ENDED_BECAUSE)."""

    def __init__(self, program_id: str, reason: str | None) -> None:
        self.reason = reason
        fresh = "send a segment without program_id to start a new program"
        if reason is None:
            super().__init__(f"program_id: no program {program_id!r}; {fresh}", 404)
        else:
            why = ENDED_BECAUSE[reason]
            super().__init__(f"program_id: program {program_id!r} {why}; {fresh}", 410)


@dataclass
class Branch:
    """One branch's sequence: ``ids`` tokenized, then ``pending`` text not yet tokenized.

    ``pin_key`` names the pin its next step continues (its own once a step of it finished,
    its parent's before); the first ``reuse_len`` of ``ids`` are that pinned sequence's.
    """

    key: str
    ids: list[int] = field(default_factory=list)
    pending: str = ""
    pin_key: str | None = None
    reuse_len: int = 0
    group: str | None = None  # the fork group of its first step
    failed: bool = False
    task: asyncio.Task[None] | None = None

    def child(self, key: str, group: str) -> Branch:
        return Branch(key, list(self.ids), self.pending, self.pin_key, self.reuse_len, group)


@dataclass
class Session:
    key: SessionKey
    branches: dict[str, Branch]
    forks: dict[int, list[str]] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)
    busy: bool = False
    stats: ProgramStats = field(default_factory=ProgramStats)
    segment: asyncio.Future[None] | None = None  # the running segment's work
    ended: str | None = None  # why it ended (ENDED_BECAUSE), once it has

    @property
    def program_id(self) -> str:
        return self.key[2]

    @property
    def cache_salt(self) -> str | None:
        return self.key[1]


class ProgramRunner:
    """The compiled programs of one tokenizer manager: its requests go through ``generation``
    (validate-and-retry around the manager). Programs idle for ``ttl_s`` end ("expired")."""

    def __init__(
        self, generation: ValidatedGeneration, ttl_s: float, max_per_tenant: int = MAX_SESSIONS
    ) -> None:
        self.generation = generation
        self.tm = generation.manager
        self.ttl_s = ttl_s
        self.max_per_tenant = max_per_tenant
        self.sessions: dict[SessionKey, Session] = {}
        self.ended: OrderedDict[SessionKey, str] = OrderedDict()  # why, RECENTLY_ENDED at most

    # ---- sessions ----------------------------------------------------------------------

    def _session(self, program_id: str | None, cache_salt: str | None, caller: str) -> Session:
        self._expire()
        if program_id is None:
            return self._create(caller, cache_salt)
        session = self.sessions.get((caller, cache_salt, program_id))
        if session is None:
            raise self.gone(program_id, cache_salt, caller)
        if session.busy:
            raise RequestError(f"program {program_id!r} is running a segment already", 409)
        return session

    def _create(self, caller: str, cache_salt: str | None) -> Session:
        own = [s for s in self.sessions.values() if s.key[:2] == (caller, cache_salt)]
        if len(own) >= self.max_per_tenant:
            self._evict(own)
        if len(self.sessions) >= MAX_SESSIONS:
            self._evict(list(self.sessions.values()))
        key = (caller, cache_salt, uuid.uuid4().hex)
        session = self.sessions[key] = Session(key, {"": Branch("")})
        return session

    def _evict(self, sessions: list[Session]) -> None:
        """End the longest idle of ``sessions``; RequestError 503 when all are running."""
        idle = [s for s in sessions if not s.busy]
        if not idle:
            raise RequestError(f"{len(sessions)} programs are running; retry when one ends", 503)
        self._end(min(idle, key=lambda s: s.used), "evicted")

    def _expire(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if not session.busy and now - session.used > self.ttl_s:
                self._end(session, "expired")

    def gone(self, program_id: str, cache_salt: str | None = None, caller: str = "") -> ProgramGone:
        """Why this tenant's ``program_id`` is not held: the error to raise."""
        self._expire()
        return ProgramGone(program_id, self.ended.get((caller, cache_salt, program_id)))

    def end(
        self,
        program_id: str,
        cache_salt: str | None = None,
        caller: str = "",
        reason: str = "deleted",
    ) -> bool:
        """End this tenant's program and unpin its KV (a running segment ends with a 409
        RequestError); False if the tenant holds no such program."""
        session = self.sessions.get((caller, cache_salt, program_id))
        if session is None:
            return False
        self._end(session, reason)
        return True

    def _end(self, session: Session, reason: str) -> None:
        del self.sessions[session.key]
        session.ended = reason
        self.ended[session.key] = reason
        while len(self.ended) > RECENTLY_ENDED:
            self.ended.popitem(last=False)
        if session.segment is not None and not session.segment.done():
            session.segment.cancel()
        for branch in session.branches.values():
            if branch.task is not None and not branch.task.done():
                branch.task.cancel()
        self.tm.release_program(ProgramRelease(session.program_id))

    # ---- running -----------------------------------------------------------------------

    async def run(
        self, request: ProgramRequest, caller: str = ""
    ) -> AsyncGenerator[ProgramEvent, None]:
        """Run one segment for ``caller``; yield its events (see the module doc). An unknown
        program (ProgramGone), unknown branches and a busy program raise RequestError before
        anything runs; a program ended while the segment runs raises RequestError 409 after
        the events that came before."""
        session = self._session(request.program_id, request.cache_salt, caller)
        for key in request.branches:
            if key not in session.branches:
                raise RequestError(f"branches: the program has no branch {key!r}")
        check_joins(request.branches, session.forks)
        events: asyncio.Queue[ProgramEvent | None] = asyncio.Queue()

        async def emit(event: ProgramEvent) -> None:
            events.put_nowait(event)

        session.busy = True
        finished = False
        work: asyncio.Future[None] | None = None
        try:
            yield ProgramStarted(session.program_id)
            _check_held(session)
            segment = _Segment(self, session, request.stream, emit)
            work = session.segment = asyncio.ensure_future(segment.run(request.branches))
            work.add_done_callback(lambda _: events.put_nowait(None))
            while (event := await events.get()) is not None:
                yield event
            _check_held(session)
            await work  # raises what the segment itself could not handle
            finished = True
            yield ProgramDone(session.program_id, dataclasses.replace(session.stats))
        finally:
            session.busy = False
            session.segment = None
            session.used = time.monotonic()
            held = self.sessions.get(session.key) is session
            if not finished:  # the caller went away mid-segment: the program cannot go on
                if work is not None and not work.done():
                    work.cancel()
                if held:
                    self._end(session, "abandoned")
            elif request.end and held:
                self._end(session, "ended")


def _check_held(session: Session) -> None:
    """RequestError 409 when the program was ended from outside (DELETE) during its segment."""
    if session.ended is not None:
        why = ENDED_BECAUSE[session.ended]
        message = f"program {session.program_id!r} {why} while a segment ran; the segment stopped"
        raise RequestError(message, 409)


class _Segment:
    """One request's ops, run against a session."""

    def __init__(self, runner: ProgramRunner, session: Session, stream: bool, emit: Emit) -> None:
        self.runner = runner
        self.tm = runner.tm
        self.generate = runner.generation.generate
        self.tokenizer = runner.tm.tokenizer
        self.session = session
        self.stream = stream
        self.emit = emit

    async def run(self, branches: dict[str, tuple[Op, ...]]) -> None:
        tasks = [
            self._start(self.session.branches[key], ops) for key, ops in branches.items() if ops
        ]
        await self._wait(tasks)
        # Branches forked in this segment and never joined finish before it ends (and the
        # forks they made in turn).
        while running := [
            b.task
            for b in self.session.branches.values()
            if b.task is not None and not b.task.done()
        ]:
            await self._wait(running)

    def _start(self, branch: Branch, ops: tuple[Op, ...]) -> asyncio.Task[None]:
        previous = branch.task

        async def body() -> None:
            if previous is not None and not previous.done():
                await asyncio.shield(previous)
            await self._run_ops(branch, ops)

        branch.task = asyncio.ensure_future(body())
        return branch.task

    @staticmethod
    async def _wait(tasks: list[asyncio.Task[None]]) -> None:
        if tasks:
            await asyncio.gather(*tasks)

    async def _run_ops(self, branch: Branch, ops: tuple[Op, ...]) -> None:
        for op in ops:
            if branch.failed:
                return
            name = getattr(op, "name", None)
            try:
                await self._op(branch, op)
            except asyncio.CancelledError:
                raise
            except (RequestError, SchedulerDied, ValueError) as exc:
                await self._fail(branch, name, getattr(exc, "status_code", 500), str(exc))
            except Exception:
                logger.exception("program %s failed", self.session.program_id)
                await self._fail(
                    branch, name, 500, "internal error while running the program; see the log"
                )

    async def _fail(self, branch: Branch, name: str | None, status: int, message: str) -> None:
        branch.failed = True
        if isinstance(status, int) and status < 400:
            status = 500
        await self.emit(OpFailed(branch.key, name, status, message))

    async def _op(self, branch: Branch, op: Op) -> None:
        if isinstance(op, TextOp):
            branch.pending += op.text
        elif isinstance(op, GenOp):
            await self._gen(branch, op)
        elif isinstance(op, SelectOp):
            await self._select(branch, op)
        elif isinstance(op, ForkOp):
            await self._fork(branch, op)
        elif isinstance(op, JoinOp):
            await self._join(op)
        elif isinstance(op, InvalidGen):
            raise RequestError(op.message)

    # ---- tokens ------------------------------------------------------------------------

    async def _encode(self, branch: Branch) -> tuple[int, int]:
        """Tokenize the branch's pending text onto its ids; (tokens re-used, tokens encoded)."""
        if not branch.pending:
            return len(branch.ids), 0
        pending, branch.pending = branch.pending, ""
        if not branch.ids:
            ids = await self.tm.tokenize(pending)
            branch.ids = list(ids)
            return 0, len(ids)
        ids = branch.ids
        start = _boundary_start(self.tokenizer, ids)
        context = ids[start - 1 : start] if start > 0 else []
        tail = ids[start:]

        def encode() -> list[int]:
            text = _decode_after(self.tokenizer, context, tail) + pending
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

        # size: the new text plus the healed tail (at most 8 tokens, counted generously).
        new = await self.tm.run_tokenizer(encode, "text", size=len(pending) + 16 * len(tail))
        same = 0
        for a, b in zip(tail, new, strict=False):
            if a != b:
                break
            same += 1
        kept = start + same
        branch.ids = ids[:kept] + new[same:]
        branch.reuse_len = min(branch.reuse_len, kept)
        return kept, len(new) - same

    def _step(self, branch: Branch, keep: bool, reuse_len: int | None = None) -> ProgramStep:
        group, branch.group = branch.group, None
        return ProgramStep(
            self.session.program_id,
            continue_from=branch.pin_key,
            reuse_len=branch.reuse_len if reuse_len is None else reuse_len,
            keep_as=branch.key if keep else None,
            group=group,
        )

    def _count(self, result: RequestOutput, reused: int, encoded: int) -> None:
        stats = self.session.stats
        stats.requests += 1
        stats.prompt_tokens += result.prompt_tokens
        stats.cached_tokens += result.cached_tokens
        stats.completion_tokens += result.completion_tokens
        stats.reused_tokens += reused
        stats.reencoded_tokens += encoded

    # ---- ops ---------------------------------------------------------------------------

    async def _gen(self, branch: Branch, op: GenOp) -> None:
        reused, encoded = await self._encode(branch)
        if not branch.ids:
            raise RequestError("the prompt is empty: a program's first gen needs text before it")
        prompt = list(branch.ids)
        step = self._step(branch, keep=True)
        async for final in self.generate(
            prompt, op.params, stream=self.stream, program=step, cache_salt=self.session.cache_salt
        ):
            if self.stream and final.delta:
                await self.emit(GenDelta(branch.key, final.delta, len(final.output_ids)))
        text, output_ids = final.text, final.output_ids
        kept, rest = await self.tm.run_tokenizer(
            lambda: _kept_output(self.tokenizer, prompt, output_ids, text),
            "text",
            size=len(text) + len(output_ids),
        )
        branch.ids = prompt + kept
        branch.pending = rest
        branch.pin_key = branch.key
        branch.reuse_len = len(prompt) + len(kept)
        meta = final.to_dict()["meta_info"]
        meta["reused_tokens"], meta["reencoded_tokens"] = reused, encoded
        self._count(final, reused, encoded)
        await self.emit(GenDone(branch.key, op.name, text, meta))

    async def _select(self, branch: Branch, op: SelectOp) -> None:
        reused, encoded = await self._encode(branch)
        ids = branch.ids
        if not ids:
            ids = branch.ids = list(await self.tm.tokenize(""))
            if not ids:
                raise RequestError("select needs text before it (the model has no BOS token)")
        start = max(1, len(ids) - HEAL_WINDOW)
        window = _decode_after(self.tokenizer, ids[start - 1 : start], ids[start:])

        def encode_choices() -> list[list[int]]:
            return [
                list(self.tokenizer(window + c, add_special_tokens=False).input_ids)
                for c in op.choices
            ]

        tails = await self.tm.run_tokenizer(
            encode_choices,
            "choices",
            size=len(op.choices) * len(window) + sum(map(len, op.choices)),
        )
        # Every choice is scored from the healed boundary (select_math.heal_boundary), known
        # here before anything runs: the window's tokens before it are the prefix's own in
        # every choice, so their KV is reused and each choice computes only the logits from
        # the boundary on (the interpreter, which cannot tokenize, re-scores the whole window).
        boundary = heal_boundary(ids[start:], tails)
        first = start + boundary
        reuse = min(branch.reuse_len, first)
        calls: list[Awaitable[RequestOutput]] = []
        # The prefix itself first when it has tokens no pin covers: it is prefilled once (the
        # choices, admitted in the same step, read its slots: the scheduler's in-step loans)
        # and pinned for the branch's next step.
        prefill = len(ids) > branch.reuse_len
        if prefill:
            calls.append(self._score(ids, -1, self._step(branch, keep=True)))
        # A choice whose tokens end at the boundary still needs one logit row (a prompt's
        # logprobs start before its last token): its first entry is dropped below.
        starts = [min(first, start + len(tail) - 1) for tail in tails]
        calls += [
            self._score(
                ids[:start] + tail, lp_start, self._step(branch, keep=False, reuse_len=reuse)
            )
            for tail, lp_start in zip(tails, starts, strict=True)
        ]
        unconditional_calls: list[Awaitable[RequestOutput]] = []
        if op.method == UNCONDITIONAL_LIKELIHOOD_NORMALIZED:
            for choice in op.choices:
                choice_ids = await self.tm.tokenize(choice, "choices")
                unconditional_calls.append(self._score(choice_ids, 0, None))
        results = await asyncio.gather(*calls, *unconditional_calls)
        scored = results[int(prefill) : int(prefill) + len(tails)]
        if prefill:
            branch.pin_key, branch.reuse_len = branch.key, len(ids)
        # From the boundary on: there, heal_boundary over these rows is 0 (some choice departs
        # from the prefix, or ends, at the boundary), so whoever replays them scores the same
        # tokens, and healed_tokens (window length - boundary) is unchanged.
        prefix_tokens = ids[first:]
        choice_tokens = [tail[boundary:] for tail in tails]
        choice_logprobs = [
            [e[0] for e in (r.input_logprobs or [])[first - lp_start :]]
            for r, lp_start in zip(scored, starts, strict=True)
        ]
        unconditional = None
        if unconditional_calls:
            unconditional = [
                [e[0] for e in r.input_logprobs or [] if e[0] is not None]
                for r in results[int(prefill) + len(tails) :]
            ]
        index, _ = pick(op.method, choice_logprobs, unconditional)
        branch.pending += op.choices[index]
        metas = [
            {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens} for r in scored
        ]
        for i, r in enumerate(results[: int(prefill) + len(tails)]):
            self._count(r, reused if i == 0 else 0, encoded if i == 0 else 0)
        await self.emit(
            SelectDone(
                branch.key, op.name, op.choices[index], prefix_tokens, choice_tokens,
                choice_logprobs, metas, unconditional, reused, encoded,
            )
        )  # fmt: skip

    async def _score(self, ids: list[int], start: int, step: ProgramStep | None) -> RequestOutput:
        return await final_output(
            self.generate(
                ids,
                SCORE_ONLY,
                return_logprob=start >= 0,
                logprob_start_len=start,
                program=step,
                cache_salt=self.session.cache_salt,
            )
        )

    async def _fork(self, branch: Branch, op: ForkOp) -> None:
        session = self.session
        if op.id in session.forks:
            raise RequestError(f"fork id {op.id} is used already in this program")
        if len(op.branches) > 1 and (branch.pending or len(branch.ids) > branch.reuse_len):
            reused, encoded = await self._encode(branch)
            if branch.ids and branch.pin_key is None:
                # The program's first KV: prefilled once and pinned, so the branches (and the
                # parent after the join) continue from a pin rather than match from the root.
                result = await self._score(branch.ids, -1, self._step(branch, keep=True))
                self._count(result, reused, encoded)
                branch.pin_key, branch.reuse_len = branch.key, len(branch.ids)
            else:
                # The branches start at once: the scheduler admits them in one step, the first
                # computes the unpinned tail they share and the others read its slots
                # (KVCacheManager.lend), so no round trip is spent prefilling it first.
                self.session.stats.reencoded_tokens += encoded
        group = f"{session.program_id}:{op.id}"
        keys = [branch_key(branch.key, op.id, i) for i in range(len(op.branches))]
        session.forks[op.id] = keys
        for key, ops in zip(keys, op.branches, strict=True):
            child = branch.child(key, group)
            session.branches[key] = child
            self._start(child, ops)

    async def _join(self, op: JoinOp) -> None:
        keys = self.session.forks.get(op.id, [])
        branches = [self.session.branches[k] for k in keys if k in self.session.branches]
        await self._wait([b.task for b in branches if b.task is not None])
        # Joined branches keep their tokens (a program may still read them) but not their pins.
        self.tm.release_program(ProgramRelease(self.session.program_id, keys))
        for b in branches:
            if b.pin_key == b.key:
                b.pin_key, b.reuse_len = None, 0


def _boundary_start(tokenizer: Any, ids: list[int]) -> int:
    """Where the re-encoded boundary begins: ``BOUNDARY_TOKENS`` from the end, moved back (up to
    twice as far) to a token that starts with whitespace, so that re-encoding starts where a
    tokenizer's pre-tokenizer would split the whole text too."""
    start = max(1, len(ids) - BOUNDARY_TOKENS)
    for position in range(start, max(0, len(ids) - 2 * BOUNDARY_TOKENS) - 1, -1):
        if position <= 0:
            break
        piece = tokenizer.convert_ids_to_tokens(ids[position])
        if isinstance(piece, str) and piece[:1] in ("Ġ", "▁", " ", "Ċ", "\n"):
            return position
    return start


def _decode_after(tokenizer: Any, context: list[int], ids: list[int]) -> str:
    """The text of ``ids`` as it reads after ``context`` (decoding them alone may drop a
    leading space, or split a character)."""
    if not ids:
        return ""
    if not context:
        return str(tokenizer.decode(ids, skip_special_tokens=False))
    both = tokenizer.decode(context + ids, skip_special_tokens=False)
    before = tokenizer.decode(context, skip_special_tokens=False)
    return (
        str(both[len(before) :])
        if both.startswith(before)
        else str(tokenizer.decode(ids, skip_special_tokens=False))
    )


def _kept_output(
    tokenizer: Any, prompt: list[int], output_ids: list[int], text: str
) -> tuple[list[int], str]:
    """The generated tokens that make up ``text`` (the output as returned: a stop string, EOS
    and special tokens cut), and whatever of ``text`` they do not cover (re-encoded later).
    Usually every token is kept; a stop cuts the last few."""
    context = prompt[-1:]
    for keep in range(len(output_ids), max(-1, len(output_ids) - 17), -1):
        decoded = _decode_after(tokenizer, context, output_ids[:keep])
        if decoded == text or (text.startswith(decoded) and not decoded.endswith("\ufffd")):
            return output_ids[:keep], text[len(decoded) :]
    return [], text
