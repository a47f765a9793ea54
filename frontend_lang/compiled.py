"""Compiled execution: a program's expressions are recorded, not run, until the program reads
something back; the recorded segment then goes to the runtime as one program request and runs
next to the KV cache (``runtime/program``).

Recording. In a compiled run, ``s += expr`` appends ``expr`` to the state's pending list,
``s.fork(n)`` records a fork (its branches record their own lists) and ``forks.join()`` a join.
Nothing is sent. A read (``s[name]``, ``s.text()``, ``get_meta_info``, ...) or the end of the
program flushes: everything pending, in every state of the run, becomes one request. So the
Python code between two reads (a tool call in an agent loop) splits the program into
segments, and the runtime keeps each branch's tokens and pinned KV from one segment to the
next.

Replay. The runtime answers with events per branch (each gen's text and meta info, each
select's scores). The recorded expressions are then executed by the interpreter, on the same
states and threads as an interpreted run, against a backend that hands out those results in
order. So the state a compiled run leaves (text, variables, meta info, messages, streamed
pieces, errors) is built by the same code as an interpreted run's.

Tracing (``Function.trace``) records the same way and stops at the first read.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_lang.backends.base import (
    Backend,
    BackendError,
    ChoiceLogprobs,
    GenOutput,
    OnDelta,
    ProgramsUnsupported,
    Prompt,
)
from frontend_lang.chat import ChatTemplate
from frontend_lang.errors import ProgramError
from frontend_lang.interpreter import execute
from frontend_lang.ir import Expr, Gen, Role, RoleBegin, RoleEnd, Select, Seq, Text

if TYPE_CHECKING:
    from frontend_lang.fork import ForkGroup
    from frontend_lang.state import ProgramState, RunContext


@dataclass(frozen=True)
class ForkRecord:
    fork_id: int
    branches: list[ProgramState]


@dataclass(frozen=True)
class JoinRecord:
    group: ForkGroup


Item = Expr | ForkRecord | JoinRecord


class TraceStop(BaseException):
    """Raised inside a traced program at its first read (BaseException: the program's own
    ``except Exception`` must not swallow it)."""

    def __init__(self, state: ProgramState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


class CompiledRun:
    """The recording and flushing of one compiled (or traced) run."""

    def __init__(self, run: RunContext, tracing: bool = False) -> None:
        self.run = run
        self.tracing = tracing
        self.program_id: str | None = None
        self.pending: dict[int, tuple[ProgramState, list[Item]]] = {}
        self.keys: dict[int, str] = {}
        self.fresh: set[int] = set()  # branches forked since the last flush
        self.fork_ids = itertools.count(1)
        self.interpreting = False  # the server has no compiled execution: interpret instead
        self.closed = False
        self.stats: dict[str, Any] = {}

    # ---- recording ---------------------------------------------------------------------

    def key(self, state: ProgramState) -> str:
        return self.keys.setdefault(id(state), "")

    def record(self, state: ProgramState, item: Item) -> None:
        entry = self.pending.get(id(state))
        if entry is None:
            entry = self.pending[id(state)] = (state, [])
        entry[1].append(item)

    def fork(self, parent: ProgramState, branches: list[ProgramState]) -> int:
        fork_id = next(self.fork_ids)
        parent_key = self.key(parent)
        for i, branch in enumerate(branches):
            self.keys[id(branch)] = f"{parent_key}/{fork_id}.{i}"
            self.fresh.add(id(branch))
        self.record(parent, ForkRecord(fork_id, branches))
        return fork_id

    def items(self, state: ProgramState) -> list[Item]:
        entry = self.pending.get(id(state))
        return entry[1] if entry is not None else []

    # ---- flushing ----------------------------------------------------------------------

    def flush(
        self, reader: ProgramState | None = None, reason: str = "", end: bool = False
    ) -> None:
        """Run everything pending as one segment and replay its results into the states; raise
        the error a state that was read (or the root) met, as the interpreter would have."""
        if self.tracing:
            if reader is not None:
                raise TraceStop(reader, reason)
            return
        if self.closed:
            return
        if end:
            self.closed = True
        pending, fresh = self.pending, self.fresh
        self.pending, self.fresh = {}, set()
        if not pending:
            if end and self.program_id is not None:
                self.run.backend.end_program(self.program_id)
            return
        if self.interpreting:
            self._interpret(pending, fresh)
            return
        try:
            request = self._request(pending, fresh, end)
            events = self.run.backend.run_program(request)
            first = next(events, None)
        except ProgramsUnsupported:
            self.interpreting = True
            self._interpret(pending, fresh)
            return
        except BackendError as exc:
            raise ProgramError(self.run.program, None, exc) from exc
        self._replay(pending, fresh, events, first)

    def close(self) -> None:
        """The run is over (or failed): drop what was not sent, and end the program in the
        runtime if it is still open there."""
        self.pending, self.fresh = {}, set()
        if self.closed:
            return
        self.closed = True
        if self.program_id is not None and not self.interpreting:
            try:
                self.run.backend.end_program(self.program_id)
            except Exception:  # noqa: BLE001 - the runtime drops idle programs itself
                pass

    def _request(
        self, pending: dict[int, tuple[ProgramState, list[Item]]], fresh: set[int], end: bool
    ) -> dict[str, Any]:
        template = self.run.backend.chat_template
        branches: dict[str, list[dict[str, Any]]] = {}
        for state_id, (state, items) in pending.items():
            if state_id not in fresh:
                shadow = _Shadow(state._began)
                branches[self.keys.get(state_id, "")] = self._ops(items, shadow, pending, template)
        request: dict[str, Any] = {"branches": branches, "stream": self.run.streaming, "end": end}
        if self.program_id is not None:
            request["program_id"] = self.program_id
        return request

    def _ops(
        self,
        items: list[Item],
        shadow: _Shadow,
        pending: dict[int, tuple[ProgramState, list[Item]]],
        template: ChatTemplate,
    ) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, ForkRecord):
                ops.append(
                    {
                        "type": "fork",
                        "id": item.fork_id,
                        "branches": [
                            self._ops(
                                pending.get(id(b), (b, []))[1],
                                _Shadow(shadow.began),
                                pending,
                                template,
                            )
                            for b in item.branches
                        ],
                    }
                )
            elif isinstance(item, JoinRecord):
                ops.append({"type": "join", "id": item.group.fork_id})
            else:
                lower(item, shadow, template, ops)
        return ops

    def _replay(
        self,
        pending: dict[int, tuple[ProgramState, list[Item]]],
        fresh: set[int],
        events: Iterator[dict[str, Any]],
        first: dict[str, Any] | None,
    ) -> None:
        queues: dict[str, queue.Queue[Any]] = {}
        lock = threading.Lock()

        def queue_of(key: str) -> queue.Queue[Any]:
            with lock:
                if key not in queues:
                    queues[key] = queue.Queue()
                    if ended:  # a replay that starts after the stream ended
                        queues[key].put(ended[0])
                return queues[key]

        def dispatch() -> None:
            failure: BaseException | None = None
            try:
                for event in itertools.chain([first] if first else [], events):
                    kind = event.get("type")
                    if kind == "program":
                        self.program_id = event["program_id"]
                    elif kind == "done":
                        self.stats = event.get("meta_info") or {}
                    elif "branch" in event:
                        queue_of(event["branch"]).put(event)
            except BaseException as exc:  # noqa: BLE001 - every waiting replay gets it
                failure = exc
            with lock:
                ended.append(_Ended(failure))
                for q in queues.values():
                    q.put(ended[0])

        ended: list[_Ended] = []
        dispatcher = threading.Thread(target=dispatch, name=f"{self.run.program}-events")
        dispatcher.start()

        def replay_backend(state: ProgramState) -> Backend:
            return _ReplayBackend(self.run.backend, _Source(queue_of(self.key(state))))

        try:
            self._play(pending, fresh, replay_backend)
        finally:
            dispatcher.join()  # the segment is drained before any error is raised

    def _interpret(
        self, pending: dict[int, tuple[ProgramState, list[Item]]], fresh: set[int]
    ) -> None:
        """The server cannot run programs: interpret what was recorded (forks prefill their
        prefix and start their branches where they were recorded)."""
        self._play(pending, fresh, None)

    def _play(
        self,
        pending: dict[int, tuple[ProgramState, list[Item]]],
        fresh: set[int],
        backend_for: Callable[[ProgramState], Backend] | None,
    ) -> None:
        """Execute the recorded items of every state: the root's on this thread, each branch's
        on its worker (a branch forked in this segment starts when its fork is reached).
        ``backend_for`` gives a state the backend that hands out the runtime's results (None:
        the real backend, interpreting)."""
        # Branches forked in this segment are started by their parent's replay, on another
        # thread: gated now, so a read of one waits for its results rather than racing them.
        for _, items in pending.values():
            for item in items:
                if isinstance(item, ForkRecord):
                    for branch in item.branches:
                        branch.open_gate()
        for state_id, (state, items) in pending.items():
            if state_id not in fresh and state._worker is not None:
                player = self._player(state, items, pending, backend_for)
                state.submit(player, self._on_skip(items, pending))
        for state_id, (state, items) in pending.items():
            if state_id not in fresh and state._worker is None:
                self._player(state, items, pending, backend_for)()

    def _player(
        self,
        state: ProgramState,
        items: list[Item],
        pending: dict[int, tuple[ProgramState, list[Item]]],
        backend_for: Callable[[ProgramState], Backend] | None,
    ) -> Callable[[], None]:
        def play() -> None:
            state._replay = backend_for(state) if backend_for is not None else None
            done = 0
            try:
                for item in items:
                    if isinstance(item, ForkRecord):
                        if backend_for is None and len(item.branches) > 1:
                            self._cache_prefix(state)  # as the interpreter's fork does
                        for branch in item.branches:
                            state._copy_into(branch)
                            branch_items = pending.get(id(branch), (branch, []))[1]
                            branch.submit(
                                self._player(branch, branch_items, pending, backend_for),
                                self._on_skip(branch_items, pending),
                            )
                    elif isinstance(item, JoinRecord):
                        item.group._gather_now()
                    else:
                        execute(state, item)
                    done += 1
            except BaseException as exc:
                self._unstarted(items[done:], exc, pending)
                raise
            finally:
                state._replay = None

        return play

    def _on_skip(
        self, items: list[Item], pending: dict[int, tuple[ProgramState, list[Item]]]
    ) -> Callable[[BaseException], None]:
        """What a replay that never runs (its state failed earlier) does: ``_unstarted``."""
        return lambda error: self._unstarted(items, error, pending)

    def _unstarted(
        self,
        items: list[Item],
        error: BaseException,
        pending: dict[int, tuple[ProgramState, list[Item]]],
    ) -> None:
        """A replay stopped with ``error`` before ``items``: the branches they fork (and
        theirs) never start, and reading one raises ``error``."""
        for item in items:
            if isinstance(item, ForkRecord):
                for branch in item.branches:
                    if branch._gate is not None:
                        branch.fail_gate(error)
                        self._unstarted(pending.get(id(branch), (branch, []))[1], error, pending)

    def _cache_prefix(self, state: ProgramState) -> None:
        try:
            self.run.backend.cache_prefix(state.prompt())
        except Exception as exc:
            raise ProgramError(self.run.program, None, exc) from exc


@dataclass
class _Shadow:
    """What lowering role blocks to text needs to know of a state: whether its first block
    (the template's ``begin``) was written."""

    began: bool


def lower(expr: Expr, shadow: _Shadow, template: ChatTemplate, ops: list[dict[str, Any]]) -> None:
    """Append the runtime ops of ``expr`` (role blocks become their template text)."""
    if isinstance(expr, Text):
        if expr.text:
            ops.append({"type": "text", "text": expr.text})
    elif isinstance(expr, Seq):
        for part in expr.parts:
            lower(part, shadow, template, ops)
    elif isinstance(expr, Gen):
        ops.append({"type": "gen", "name": expr.name, "sampling_params": expr.sampling_params()})
    elif isinstance(expr, Select):
        ops.append(
            {
                "type": "select",
                "name": expr.name,
                "choices": list(expr.choices),
                "choices_method": expr.choices_method,
            }
        )
    elif isinstance(expr, Role):
        lower(RoleBegin(expr.role), shadow, template, ops)
        if expr.content is not None:
            lower(expr.content, shadow, template, ops)
        lower(RoleEnd(expr.role), shadow, template, ops)
    elif isinstance(expr, RoleBegin):
        if not shadow.began:
            shadow.began = True
            lower(Text(template.begin), shadow, template, ops)
        lower(Text(template.prefix[expr.role]), shadow, template, ops)
    elif isinstance(expr, RoleEnd):
        lower(Text(template.suffix[expr.role]), shadow, template, ops)
    else:
        raise TypeError(f"unknown expression {expr!r}")


@dataclass(frozen=True)
class _Ended:
    failure: BaseException | None


class _Source:
    """One branch's results, in order, as the runtime sends them."""

    def __init__(self, events: queue.Queue[Any]) -> None:
        self.events = events

    def next(self) -> dict[str, Any]:
        item = self.events.get()
        if isinstance(item, _Ended):
            self.events.put(item)  # for the next read too
            if item.failure is not None:
                if isinstance(item.failure, BackendError):
                    raise item.failure
                raise BackendError(f"the program stream failed: {item.failure}") from item.failure
            raise BackendError("the runtime ended the program segment without this result")
        if item.get("type") == "error":
            raise BackendError(str(item.get("message")))
        return dict(item)


class _ReplayBackend(Backend):
    """The backend a replayed state calls: it hands out the runtime's results in order."""

    def __init__(self, real: Backend, source: _Source) -> None:
        self.real = real
        self.source = source
        self._unconditional: list[list[float]] | None = None

    @property
    def chat_template(self) -> ChatTemplate:
        return self.real.chat_template

    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], on_delta: OnDelta | None = None
    ) -> GenOutput:
        while True:
            event = self.source.next()
            if event["type"] == "delta":
                if on_delta is not None:
                    on_delta(event["text"])
                continue
            if event["type"] != "gen":
                raise BackendError(f"expected a gen result, the runtime sent {event['type']}")
            return GenOutput(event["text"], event["meta_info"])

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        event = self.source.next()
        if event["type"] != "select":
            raise BackendError(f"expected a select result, the runtime sent {event['type']}")
        self._unconditional = event.get("unconditional")
        return ChoiceLogprobs(
            prefix_tokens=list(event["prefix_tokens"]),
            choice_tokens=[list(row) for row in event["choice_tokens"]],
            choice_logprobs=[list(row) for row in event["choice_logprobs"]],
            meta=[dict(m) for m in event["meta"]],
        )

    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        if self._unconditional is None:
            raise BackendError("the runtime sent no unconditional logprobs")
        return self._unconditional
