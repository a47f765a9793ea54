"""``ProgramState``: the text, variables and chat messages of one running program, and its forks.

The root state of a run executes each ``s += expr`` at once, on the program's thread, so an
error raises at the line that caused it. A fork branch executes on its own worker thread, in
order: ``f += fl.gen(...)`` returns at once, so the branches of a fork generate concurrently
and the runtime batches them. Reading a branch (``f["x"]``, ``f.text()``), ``forks.join()``
and the end of the run wait for it and re-raise its first error.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from frontend_lang.backends.base import Backend, Prompt
from frontend_lang.compiled import CompiledRun
from frontend_lang.errors import ProgramError
from frontend_lang.fork import ForkGroup
from frontend_lang.interpreter import execute
from frontend_lang.ir import Expr, RoleBegin, RoleEnd, as_expr

_END = object()


class RunContext:
    """What every state of one run shares: the program's name, the backend, the fork branches
    to drain when the program returns, and (streaming) the program thread's outcome."""

    def __init__(
        self, program: str, backend: Backend, compiled: bool = False, tracing: bool = False
    ) -> None:
        self.program = program
        self.backend = backend
        self.streaming = False  # the root state streams its text (run(..., stream=True))
        # Compiled (or traced) runs record expressions and send them as program segments.
        self.compiled = CompiledRun(self, tracing) if compiled or tracing else None
        self.branches: list[ProgramState] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.program_thread: int | None = None

    def execute(self, body: Callable[[], Any]) -> None:
        """Run the program body, then wait for every fork branch; raise the body's error, else
        the first branch error. Branches are always drained, so nothing is left running."""
        self.program_thread = threading.get_ident()
        try:
            body()
            if self.compiled is not None:
                self.compiled.flush(end=True)
        finally:
            if self.compiled is not None:
                self.compiled.close()
            branch_error = self._drain_branches()
        if branch_error is not None:
            raise branch_error

    def _drain_branches(self) -> BaseException | None:
        first: BaseException | None = None
        with self.lock:
            branches = list(self.branches)
        for branch in branches:
            try:
                branch.sync()
            except BaseException as exc:  # noqa: BLE001 - re-raised by execute
                first = first or exc
            finally:
                branch._close_worker()
        return first


class ProgramState:
    """The state ``s`` a program appends to. Read it with ``s[name]``, ``s.text()``,
    ``s.messages()``, ``s.get_meta_info(name)``; stream it with ``s.text_iter()``."""

    def __init__(self, run: RunContext, stream: bool = False) -> None:
        self._run = run
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, Any] = {}
        self._parsed: dict[str, Any] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: str | None = None
        self._open_start = 0
        self._began = False
        self._assigned: list[str] = []  # names set since this state was created (for join)
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._gate: Future[None] | None = None  # see open_gate
        self._error: BaseException | None = None
        self._events: queue.Queue[Any] | None = queue.Queue() if stream else None
        self._replay: Backend | None = None  # a compiled run's results, while replayed

    # ---- appending -------------------------------------------------------------------

    def __iadd__(self, other: Expr | str) -> ProgramState:
        expr = as_expr(other)
        if self._run.compiled is not None:
            self._run.compiled.record(self, expr)
            return self
        self.submit(lambda: execute(self, expr))
        return self

    @contextmanager
    def _role(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self) -> Any:
        """``with s.system(): s += ...``: the appended text is a system message."""
        return self._role("system")

    def user(self) -> Any:
        return self._role("user")

    def assistant(self) -> Any:
        return self._role("assistant")

    def fork(self, n: int) -> ForkGroup:
        """``n`` branches continuing from here, each with a copy of the text and variables.
        The shared prefix is prefilled once first, so every branch's first call hits the cache.
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        compiled = self._run.compiled
        if compiled is not None:  # recorded: the branches copy this state when it runs
            branches = [self._new_branch() for _ in range(n)]
            with self._run.lock:
                self._run.branches.extend(branches)
            fork_id = compiled.fork(self, branches)
            return ForkGroup(self, branches, fork_id)
        self.sync()
        if n > 1:
            try:
                self._run.backend.cache_prefix(self.prompt())
            except Exception as exc:
                raise ProgramError(self._run.program, None, exc) from exc
        branches = [self._branch() for _ in range(n)]
        with self._run.lock:
            self._run.branches.extend(branches)
        return ForkGroup(self, branches)

    # ---- reading ---------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        self.sync(f"reads s[{name!r}]")
        if name not in self._vars:
            known = ", ".join(sorted(self._vars)) or "none"
            raise KeyError(f"program {self._run.program!r} has no variable {name!r} (has: {known})")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self.sync(f"tests {name!r} in s")
        return name in self._vars

    def parsed(self, name: str) -> Any:
        """The parsed value of a constrained gen: the object a ``json_schema`` gen produced,
        the value of a ``dtype`` gen; the text for other gens and selects."""
        self[name]
        return self._parsed[name]

    def get_meta_info(self, name: str) -> Any:
        """What the runtime reported for the call that set ``name``: for gen its meta info
        (prompt_tokens, completion_tokens, cached_tokens, finish_reason), for select the
        choices' scores; after a join, the list of the branches' meta infos."""
        self.sync(f"reads the meta info of {name!r}")
        return self._meta[name]

    def text(self) -> str:
        self.sync("reads the text")
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The role blocks so far as chat messages, the open block (if any) last."""
        self.sync("reads the messages")
        messages = [dict(m) for m in self._messages]
        if self._open_role is not None:
            messages.append({"role": self._open_role, "content": self._text[self._open_start :]})
        return messages

    def sync(self, reason: str = "reads the state") -> None:
        """Wait until everything appended so far has run; raise the first error. In a compiled
        run, what is pending is sent first (a read ends the segment)."""
        compiled = self._run.compiled
        if compiled is not None and (
            self._events is None or threading.get_ident() == self._run.program_thread
        ):
            compiled.flush(self, reason)
        if self._worker is not None and self._pending is not None:
            self._wait_pending()
        elif self._events is not None and threading.get_ident() != self._run.program_thread:
            self._run.done.wait()
            if self._run.error is not None:
                raise self._run.error
        if self._error is not None:
            raise self._error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Pieces of text as a streamed run produces them (only ``var_name``'s, if given);
        they concatenate to ``s.text()``. Raises the program's error at the end. Iterate once."""
        events = self._stream_events()
        while (item := events.get()) is not _END:
            if var_name is None or item[0] == var_name:
                yield item[1]
        self.sync()

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """``text_iter`` for an asyncio consumer."""
        events = self._stream_events()
        loop = asyncio.get_running_loop()
        while (item := await loop.run_in_executor(None, events.get)) is not _END:
            if var_name is None or item[0] == var_name:
                yield item[1]
        self.sync()

    def __repr__(self) -> str:
        return f"ProgramState({self._run.program!r}, vars={sorted(self._vars)})"

    # ---- the interpreter's interface (fork/join and execute use it; programs need not) ----

    @property
    def backend(self) -> Backend:
        return self._replay or self._run.backend

    @property
    def program(self) -> str:
        return self._run.program

    @property
    def streaming(self) -> bool:
        return self._events is not None

    @property
    def assigned(self) -> list[str]:
        """Variable names set since this state was created (a branch's own, for join)."""
        return list(self._assigned)

    def entry(self, name: str) -> tuple[Any, Any, Any]:
        """(value, meta info, parsed value) of variable ``name``; Nones when it is unset."""
        return self._vars.get(name), self._meta.get(name), self._parsed.get(name)

    def prompt(self) -> Prompt:
        """What a model call continues: the text, the closed messages, the open role's text."""
        content = self._text[self._open_start :] if self._open_role is not None else ""
        return Prompt(self._text, [dict(m) for m in self._messages], self._open_role, content)

    def append_text(self, text: str, var: str | None = None, emit: bool = True) -> None:
        """Add ``text`` (produced for variable ``var``, if any); streamed when ``emit``."""
        self._text += text
        if emit and text:
            self.emit_text(text, var)

    def emit_text(self, text: str, var: str | None) -> None:
        """Send ``text`` to a streamed run's ``text_iter`` (a no-op otherwise)."""
        if self._events is not None:
            self._events.put((var, text))

    def set_var(self, name: str, value: Any, meta: Any, parsed: Any) -> None:
        """Set variable ``name`` (``s[name]``, ``get_meta_info``, ``parsed``)."""
        self._vars[name] = value
        self._meta[name] = meta
        self._parsed[name] = parsed
        if name not in self._assigned:
            self._assigned.append(name)

    def begin_role(self, role: str) -> None:
        """Open a ``role`` block with the backend's chat template (ValueError if one is open)."""
        if self._open_role is not None:
            raise ValueError(f"cannot open a {role} block inside the open {self._open_role} block")
        template = self._run.backend.chat_template
        if not self._began:
            self.append_text(template.begin)
            self._began = True
        self.append_text(template.prefix[role])
        self._open_role, self._open_start = role, len(self._text)

    def end_role(self, role: str) -> None:
        """Close the open ``role`` block; its text becomes a message."""
        if self._open_role != role:
            raise ValueError(f"closing a {role} block, but the open block is {self._open_role}")
        content = self._text[self._open_start :]
        self.append_text(self._run.backend.chat_template.suffix[role])
        self._messages.append({"role": role, "content": content})
        self._open_role = None

    def submit(
        self,
        task: Callable[[], None],
        on_skip: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Run ``task`` now, or on a fork branch's worker after what is queued (errors are
        raised by the next ``sync``; ``on_skip`` is told the error when one earlier in the
        queue means ``task`` never runs)."""
        if self._worker is None:
            task()
            return

        def guarded() -> None:
            if self._error is None:
                try:
                    task()
                except BaseException as exc:  # noqa: BLE001 - raised again by sync()
                    self._error = exc
            elif on_skip is not None:
                on_skip(self._error)

        self._pending = self._worker.submit(guarded)
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set_result(None)

    def open_gate(self) -> None:
        """A compiled segment forked this branch: its work is submitted later, by its parent's
        replay on another thread. Until then ``sync`` waits on the gate (it would otherwise
        find nothing queued and read the branch before its results were replayed)."""
        self._gate = Future()
        self._pending = self._gate

    def fail_gate(self, error: BaseException) -> None:
        """The parent's replay stopped before it started this branch: a ``sync`` raises
        ``error`` instead of waiting for ever."""
        gate, self._gate = self._gate, None
        if gate is not None:
            self._error = error
            gate.set_exception(error)

    def _wait_pending(self) -> None:
        """Wait for the last task queued on this branch's worker, and for any queued while
        waiting (a gate is replaced by the branch's real work when its parent submits it)."""
        while True:
            pending = self._pending
            assert pending is not None
            pending.result()
            if pending is self._pending:
                return

    def _branch(self) -> ProgramState:
        branch = self._new_branch()
        self._copy_into(branch)
        return branch

    def _new_branch(self) -> ProgramState:
        branch = ProgramState(self._run)
        branch._worker = ThreadPoolExecutor(1, thread_name_prefix=f"{self._run.program}-fork")
        return branch

    def _copy_into(self, branch: ProgramState) -> None:
        """Make ``branch`` a copy of this state (a fork's branch, when the fork runs)."""
        branch._text = self._text
        branch._vars = dict(self._vars)
        branch._meta = dict(self._meta)
        branch._parsed = dict(self._parsed)
        branch._messages = [dict(m) for m in self._messages]
        branch._open_role, branch._open_start = self._open_role, self._open_start
        branch._began = self._began

    def _close_worker(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _stream_events(self) -> queue.Queue[Any]:
        if self._events is None:
            raise ValueError("text_iter needs a streamed run: program.run(..., stream=True)")
        return self._events

    def _finish_stream(self) -> None:
        if self._events is not None:
            self._events.put(_END)
