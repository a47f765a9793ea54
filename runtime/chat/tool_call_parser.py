"""The incremental tool-call parser: text in, content and call events out, in one format's
syntax (``grammar.tool_call_formats``). The contract is in ``runtime.chat.tool_calls``.

The output is read as content until a section of calls opens (a format's marker, or a bare
start at the beginning of the output, held back until it proves to be a call); a section reads
call objects (``CallScanner``) and the framing around them, then content resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from runtime.chat.tool_call_events import (
    ToolCall,
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallEvent,
    ToolCallStart,
    new_call_id,
)
from runtime.chat.tool_call_formats import tool_call_format
from runtime.chat.tool_call_scanner import CallScanner


@dataclass
class _Call:
    scanner: CallScanner = field(default_factory=CallScanner)
    index: int | None = None  # set once started
    id: str = ""
    skip: bool = False  # read to its end but not reported
    sent: int = 0  # characters of arguments text sent


@dataclass
class _Section:
    committed: bool  # False: opened by a bare start, not yet known to hold a call
    state: str  # list_open, call_start, in_call, after_call
    raw: str = ""  # text read while not committed
    call: _Call | None = None


class ToolCallParser:
    """Splits generated text, fed in pieces, into content and tool-call events
    (``runtime.chat.tool_calls`` has the contract). ``calls`` holds the calls that ended,
    in order; ``reported`` every call that started, as its events told it (name, the
    arguments sent so far), by index; ``incomplete`` the indexes of those dropped, and
    ``cut_off`` whether the output ended inside a started call."""

    def __init__(
        self,
        tool_names: set[str],
        max_calls: int | None = None,
        fmt: str = "hermes",
        constrained: bool = False,
    ) -> None:
        self.syntax = tool_call_format(fmt)
        self.tool_names = set(tool_names)
        self.max_calls = max_calls
        self.constrained = constrained
        self.calls: list[ToolCall] = []
        self.reported: list[ToolCall] = []
        self.incomplete: set[int] = set()
        self.cut_off = False
        self.started = 0  # calls started: the next call's index
        self.saw_markup = False  # a section of calls was entered
        self._events: list[ToolCallEvent] = []
        self._pending = ""  # text not yet decided
        self._held_space = ""  # content's trailing whitespace: dropped if a call follows
        self._content_sent = False  # some content has been emitted
        self._at_start = True  # nothing but whitespace so far
        self._finishing = False
        self._section: _Section | None = None
        self._swallow: str | None = None  # skipping a broken section up to this ("": the end)

    def feed(self, text: str) -> list[ToolCallEvent]:
        self._pending += text
        self._run()
        return self._take()

    def finish(self) -> list[ToolCallEvent]:
        """The events left once the output is complete; the parser is spent afterwards."""
        self._finishing = True
        self._run()
        section = self._section
        if section is not None and not section.committed and not _names_a_call(section):
            self._refute()
            self._run()
        elif section is not None:
            self._commit(section)
            self.cut_off = self._drop_started(section)
        self._section, self._pending = None, ""
        if self._held_space and not (self.calls or self.saw_markup):
            self._emit(self._held_space)
        self._held_space = ""
        return self._take()

    def _take(self) -> list[ToolCallEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: ToolCallEvent) -> None:
        self._report(event)
        if self.constrained and isinstance(event, str):
            return
        last = self._events[-1] if self._events else None
        if isinstance(event, str) and isinstance(last, str):
            self._events[-1] = last + event
        elif (
            isinstance(event, ToolCallArguments)
            and isinstance(last, ToolCallArguments)
            and last.index == event.index
        ):
            self._events[-1] = ToolCallArguments(event.index, last.fragment + event.fragment)
        else:
            self._events.append(event)

    def _report(self, event: ToolCallEvent) -> None:
        if isinstance(event, str):
            self._content_sent = self._content_sent or bool(event)
        elif isinstance(event, ToolCallStart):
            self.reported.append(ToolCall(event.name, "", event.id))
        elif isinstance(event, ToolCallArguments):
            call = self.reported[event.index]
            self.reported[event.index] = replace(call, arguments=call.arguments + event.fragment)
        elif isinstance(event, ToolCallDropped):
            self.incomplete.add(event.index)

    def _run(self) -> None:
        progress = True
        while self._pending and progress:
            if self._swallow is not None:
                progress = self._swallow_step()
            elif self._section is None:
                progress = self._content_step()
            else:
                progress = self._section_step(self._section)

    def _content(self, text: str) -> None:
        text = self._held_space + text
        if self.saw_markup and not self._content_sent:  # content begins after calls
            text = text.lstrip()
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            self._emit(body)

    def _content_step(self) -> bool:
        syntax, text = self.syntax, self._pending
        if self._at_start:
            stripped = text.lstrip()
            self._held_space += text[: len(text) - len(stripped)]
            self._pending = text = stripped
            if not text:
                return False
            if syntax.marker.startswith(text) and not self._finishing:
                return False  # may be the marker
            self._at_start = False
            if syntax.bare_start and text.startswith(syntax.bare_start):
                if not text.startswith(syntax.marker):
                    self._open(committed=False)
                    return True
        start = text.find(syntax.marker)
        if start < 0:
            keep = _partial_suffix(text, syntax.marker)
            self._content(text[: len(text) - keep])
            self._pending = text[len(text) - keep :]
            if self._finishing and not self.saw_markup:  # after calls, a cut-off marker
                self._content(self._pending)
                self._pending = ""
            return False
        self._content(text[:start])
        self._pending = text[start + len(syntax.marker) :]
        self._open(committed=True)
        return True

    def _open(self, committed: bool) -> None:
        state = "list_open" if self.syntax.list_open else "call_start"
        self._section = _Section(committed=False, state=state)
        if committed:
            self._commit(self._section)

    def _commit(self, section: _Section) -> None:
        section.committed, section.raw = True, ""
        self.saw_markup = True
        self._held_space = ""

    def _refute(self) -> bool:
        """A tentative section is content after all: read its text again as content."""
        assert self._section is not None
        self._pending = self._section.raw + self._pending
        self._section = None
        return True

    def _consume(self, section: _Section, count: int) -> None:
        if not section.committed:
            section.raw += self._pending[:count]
        self._pending = self._pending[count:]

    def _section_step(self, section: _Section) -> bool:
        syntax = self.syntax
        if section.state == "in_call":
            return self._call_step(section)
        text = self._pending.lstrip()
        self._consume(section, len(self._pending) - len(text))
        if not text:
            return False
        if section.state == "list_open":
            if not text.startswith(syntax.list_open):
                return self._broken(section)
            self._consume(section, len(syntax.list_open))
            section.state = "call_start"
        elif section.state == "call_start":
            if text.startswith("{"):
                section.call, section.state = _Call(), "in_call"
            elif syntax.list_close and text.startswith(syntax.list_close):
                if not section.committed:  # an empty list is no call
                    return self._refute()
                self._consume(section, len(syntax.list_close))
                self._section = None
            else:
                return self._broken(section)
        else:
            return self._after_call(section, text)
        return True

    def _after_call(self, section: _Section, text: str) -> bool:
        syntax = self.syntax
        close = syntax.item_close or syntax.list_close
        if close and text.startswith(close):
            self._consume(section, len(close))
            self._section = None
        elif close and close.startswith(text):
            return False
        elif syntax.separator_mark and text.startswith(syntax.separator_mark):
            self._consume(section, len(syntax.separator_mark))
            section.state = "call_start"
        elif syntax.item_close:
            return self._broken(section)
        elif not syntax.list_close and text.startswith("{"):
            section.state = "call_start"
        elif syntax.list_close:
            return self._broken(section)
        else:
            self._section = None  # the calls are over; the rest is content
        return True

    def _call_step(self, section: _Section) -> bool:
        assert section.call is not None
        call, scanner = section.call, section.call.scanner
        self._consume(section, scanner.feed(self._pending))
        if call.index is None and not call.skip:
            verdict = self._verdict(scanner)
            if verdict == "skip" and not section.committed:
                return self._refute()
            if verdict == "skip":
                call.skip = True
            elif verdict == "start":
                self._start(section, call, scanner)
        if call.index is not None:
            fragment = scanner.arguments_text(call.sent)
            if fragment:
                self._emit(ToolCallArguments(call.index, fragment))
                call.sent += len(fragment)
        if scanner.error:
            return self._broken(section)
        if not scanner.done:
            return False
        if call.index is not None:
            self._end(call, scanner)
        section.call, section.state = None, "after_call"
        return True

    def _verdict(self, scanner: CallScanner) -> str:
        """start, skip, or wait for more text."""
        if scanner.error or scanner.bad_name:
            return "skip"
        if scanner.name is None:
            return "skip" if scanner.done else "wait"
        if scanner.name not in self.tool_names:
            return "skip"
        if scanner.args_start is None:
            return "start" if scanner.done else "wait"
        return "start" if scanner.text[scanner.args_start] == "{" else "skip"

    def _start(self, section: _Section, call: _Call, scanner: CallScanner) -> None:
        if not section.committed:
            self._commit(section)
        if self.max_calls is not None and self.started >= self.max_calls:
            call.skip = True
            return
        call.index, call.id = self.started, new_call_id()
        self.started += 1
        assert scanner.name is not None
        self._emit(ToolCallStart(call.index, call.id, scanner.name))

    def _end(self, call: _Call, scanner: CallScanner) -> None:
        assert call.index is not None
        result = scanner.result()
        if result is None:
            self._emit(ToolCallDropped(call.index))
            return
        name, arguments = result
        if not call.sent:  # no arguments member: "{}"
            self._emit(ToolCallArguments(call.index, arguments))
        tool_call = ToolCall(name, arguments, call.id)
        self.calls.append(tool_call)
        self._emit(ToolCallEnd(call.index, tool_call))

    def _drop_started(self, section: _Section) -> bool:
        """Drop the section's started call, if any; whether there was one."""
        call = section.call
        if call is None or call.index is None:
            return False
        self._emit(ToolCallDropped(call.index))
        return True

    def _broken(self, section: _Section) -> bool:
        """The section cannot be followed further: content if it was tentative, else its
        started call is dropped and the rest of its block skipped."""
        if not section.committed:
            return self._refute()
        self._drop_started(section)
        self._section = None
        self._swallow = self.syntax.item_close
        return True

    def _swallow_step(self) -> bool:
        close = self._swallow
        end = self._pending.find(close) if close else -1
        if end < 0:
            keep = 0 if self._finishing or not close else _partial_suffix(self._pending, close)
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        self._pending = self._pending[end + len(close or "") :]
        self._swallow = None
        return True


def _names_a_call(section: _Section) -> bool:
    """Whether a tentative section cut off by the end of the output was writing a call."""
    return section.call is not None and section.call.scanner.first_key == "name"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
