"""The reader of the ``generic`` format's reply envelope: under tool_choice "auto" a model
whose template has no tool syntax replies with one JSON object (the grammar
``grammar.tool_calls.reply_envelope_ebnf`` holds it to this; ``runtime.chat.generic_tools``
describes it in the prompt)::

    {"tool_call": {"name": NAME, "arguments": ARGS}}
    {"tool_calls": [{"name": NAME, "arguments": ARGS}, ...]}
    {"response": ANSWER}

``EnvelopeParser`` turns it into the events of ``runtime.chat.tool_calls``'s contract as it
streams in: a call starts once its name is read, its arguments go out as written, and it ends
when its object closes; a string response goes out as content, unescaped, as it is written
(any other response value, from a response format, as its JSON text once complete). A call
equal in name and arguments to an earlier one of the reply (whitespace outside strings aside)
is dropped without a trace: its events are held back while it reads as the start of an
earlier call, and go out once it differs (the grammar's guard, ``grammar.distinct_calls``,
ends the list after such a repeat). A reply
that is no envelope (a grammar of the request's own shaped it) is read as free text in the
generic call syntax (``<tool_call>...</tool_call>``).
"""

from __future__ import annotations

import json
import re

from runtime.chat.tool_call_events import (
    ToolCall,
    ToolCallArguments,
    ToolCallDropped,
    ToolCallEnd,
    ToolCallEvent,
    ToolCallStart,
    new_call_id,
)
from runtime.chat.tool_call_parser import ToolCallParser

_OPEN = re.compile(r'\s*\{\s*"(tool_call|tool_calls|response)"\s*:')
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
_SPACE = re.compile(r"\s*")
_LIST_OPEN = re.compile(r"\s*\[")
_LIST_NEXT = re.compile(r"\s*([,\]])")
_CALL_CLOSE = re.compile(r"\s*\}")
# One escape; a high surrogate's takes its low half along when it is there.
_ESCAPE = re.compile(
    r"\\(?:u[dD][89abAB][0-9a-fA-F]{2}(?:\\u[0-9a-fA-F]{4})?|u[0-9a-fA-F]{4}|[^u])"
)
# Longer than the longest head the grammar writes before a decision: a reply still without
# its envelope's opening by then is no envelope.
_OPEN_PATIENCE = 64


class EnvelopeParser:
    """Splits a reply envelope, fed in pieces, into content and tool-call events. ``calls``
    holds the calls that ended, in order; ``saw_markup`` is set once the reply is seen to
    call tools. ``max_calls``: calls past it are read but not reported."""

    def __init__(self, tool_names: set[str], max_calls: int | None = None) -> None:
        self.tool_names = set(tool_names)
        self.max_calls = max_calls
        self._calls: list[ToolCall] = []
        self._reported: list[ToolCall] = []
        self._incomplete: set[int] = set()
        self._cut_off = False
        self._saw_markup = False
        self._free: ToolCallParser | None = None  # reads a reply that is no envelope
        self._text = ""
        self._pos = 0  # everything before it has been read
        # open, response, list, call, arguments, call_close, next, string, value, done
        self._state = "open"
        self._name = ""
        self._index: int | None = None  # the call being read, when it is reported
        self._id = ""
        self._arguments_start = self._arguments_end = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started = 0
        self._held: list[ToolCallEvent] | None = None  # the events of a possible repeat

    @property
    def calls(self) -> list[ToolCall]:
        return self._free.calls if self._free is not None else self._calls

    @property
    def saw_markup(self) -> bool:
        return self._free.saw_markup if self._free is not None else self._saw_markup

    @property
    def reported(self) -> list[ToolCall]:
        """Every call that started, as its events told it (name, the arguments sent so
        far), by index: what a stream of this reply sent, cut-off calls included."""
        return self._free.reported if self._free is not None else self._reported

    @property
    def incomplete(self) -> set[int]:
        """The indexes of the started calls that were dropped (cut off)."""
        return self._free.incomplete if self._free is not None else self._incomplete

    @property
    def cut_off(self) -> bool:
        """Whether the reply ended inside a started call."""
        return self._free.cut_off if self._free is not None else self._cut_off

    def feed(self, text: str) -> list[ToolCallEvent]:
        if self._free is not None:
            return self._free.feed(text)
        self._text += text
        events: list[ToolCallEvent] = []
        while self._step(events):
            pass
        return self._noted(events)

    def _noted(self, events: list[ToolCallEvent]) -> list[ToolCallEvent]:
        """``events``, after noting the calls they start and the arguments they send."""
        for event in events:
            if isinstance(event, ToolCallStart):
                self._reported.append(ToolCall(event.name, "", event.id))
            elif isinstance(event, ToolCallArguments):
                call = self._reported[event.index]
                self._reported[event.index] = ToolCall(
                    call.name, call.arguments + event.fragment, call.id
                )
            elif isinstance(event, ToolCallDropped):
                self._incomplete.add(event.index)
                self._cut_off = True
        return events

    def finish(self) -> list[ToolCallEvent]:
        """The events left once the output is complete; the parser is spent afterwards."""
        if self._free is not None:
            return self._free.finish()
        return self._noted(self._finish())

    def _finish(self) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        while self._step(events):
            pass
        rest = self._text[self._pos :]
        if self._state == "value":
            try:
                _, end = json.JSONDecoder().raw_decode(self._text, self._pos)
            except ValueError:
                end = len(self._text)  # cut off: what there is
            events.append(self._text[self._pos : end])
        elif self._state == "open" and rest:
            events.append(rest)
        elif self._state in ("arguments", "call_close") and self._index is not None:
            events += self._held or []  # a cut-off start of a repeat is kept as cut off
            self._held = None
            events.append(ToolCallDropped(self._index))
        self._state, self._pos = "done", len(self._text)
        return [e for e in events if e != ""]

    def _step(self, events: list[ToolCallEvent]) -> bool:
        """Reads what it can from ``_pos`` in the current state; False when it must wait."""
        text, state = self._text, self._state
        if state == "open":
            match = _OPEN.match(text, self._pos)
            if match is None:
                rest = text[self._pos :].lstrip()
                if (rest and not rest.startswith("{")) or len(rest) > _OPEN_PATIENCE:
                    self._read_freely(events)
                return False
            key = match.group(1)
            self._pos = match.end()
            if key == "response":
                self._state = "response"
            else:
                self._saw_markup = True
                self._state = "list" if key == "tool_calls" else "call"
            return True
        if state == "response":
            self._pos = _SPACE.match(text, self._pos).end()  # type: ignore[union-attr]
            if self._pos == len(text):
                return False
            self._state = "value"
            if text[self._pos] == '"':
                self._state, self._pos = "string", self._pos + 1
            return True
        if state == "string":
            return self._string_step(events)
        if state == "list":
            return self._advance(_LIST_OPEN, "call")
        if state == "call":
            return self._call_head(events)
        if state == "arguments":
            return self._arguments_step(events)
        if state == "call_close":
            if not self._advance(_CALL_CLOSE, "next"):
                return False
            self._end_call(events)
            return True
        if state == "next":
            match = _LIST_NEXT.match(text, self._pos)
            if match is None:
                return False
            self._pos = match.end()
            self._state = "call" if match.group(1) == "," else "done"
            return True
        return False  # value (read at the end), done

    def _read_freely(self, events: list[ToolCallEvent]) -> None:
        """The reply is no envelope (a grammar of the request's own shaped it): it is read in
        the generic call syntax, as free text is."""
        self._free = ToolCallParser(self.tool_names, self.max_calls, "generic")
        events += self._free.feed(self._text)

    def _advance(self, pattern: re.Pattern[str], state: str) -> bool:
        match = pattern.match(self._text, self._pos)
        if match is None:
            return False
        self._pos, self._state = match.end(), state
        return True

    def _call_head(self, events: list[ToolCallEvent]) -> bool:
        match = _CALL_HEAD.match(self._text, self._pos)
        if match is None:
            return False
        self._name = json.loads(match.group(1))
        self._pos = self._arguments_start = match.end()
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        self._index = None
        known = self._name in self.tool_names
        if known and (self.max_calls is None or self._started < self.max_calls):
            self._index, self._id = self._started, new_call_id()
            self._started += 1
            start = ToolCallStart(self._index, self._id, self._name)
            if any(call.name == self._name for call in self._calls):
                self._held = [start]
            else:
                events.append(start)
        return True

    def _arguments_step(self, events: list[ToolCallEvent]) -> bool:
        """Scans the arguments value to its end (depth back to 0), sending what it read."""
        text = self._text
        if self._depth == 0:  # not yet at the value: skip the space before it
            self._pos = self._arguments_start = _SPACE.match(text, self._pos).end()  # type: ignore[union-attr]
        start, end = self._pos, None
        for i in range(start, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        stop = len(text) if end is None else end
        self._pos = stop
        if self._index is not None and stop > start:
            fragment = ToolCallArguments(self._index, text[start:stop])
            if self._held is None:
                events.append(fragment)
            else:
                self._held.append(fragment)
                self._release_unless_repeat(events, stop, complete=False)
        if end is None:
            return False
        self._state, self._arguments_end = "call_close", end
        return True

    def _release_unless_repeat(self, events: list[ToolCallEvent], end: int, complete: bool) -> None:
        """Sends the held events once the call's arguments so far (up to ``end``;
        ``complete``: whole) no longer read as an earlier call's of the same name."""
        assert self._held is not None
        written = _without_layout(self._text[self._arguments_start : end])
        for call in self._calls:
            earlier = _without_layout(call.arguments)
            if call.name == self._name and (
                earlier == written if complete else earlier.startswith(written)
            ):
                return
        events += self._held
        self._held = None

    def _end_call(self, events: list[ToolCallEvent]) -> None:
        if self._index is None:
            return
        if self._held is not None:
            self._release_unless_repeat(events, self._arguments_end, complete=True)
            if self._held is not None:  # a repeat: as if it had never started
                self._held, self._index = None, None
                self._started -= 1
                return
        arguments = self._text[self._arguments_start : self._arguments_end]
        call = ToolCall(self._name, arguments, self._id)
        self._calls.append(call)
        events.append(ToolCallEnd(self._index, call))
        self._index = None

    def _string_step(self, events: list[ToolCallEvent]) -> bool:
        """Sends the response string's characters, unescaped, up to its closing quote (an
        escape sequence waits until it is whole)."""
        text, pos = self._text, self._pos
        pieces: list[str] = []
        while pos < len(text):
            char = text[pos]
            if char == '"':
                self._state = "done"
                pos += 1
                break
            if char != "\\":
                run_end = pos
                while run_end < len(text) and text[run_end] not in '"\\':
                    run_end += 1
                pieces.append(text[pos:run_end])
                pos = run_end
                continue
            match = _ESCAPE.match(text, pos)
            if match is None or _lone_high_surrogate(match) and len(text) - pos < 12:
                break  # the escape is not complete yet
            pieces.append(json.loads(f'"{match.group(0)}"'))
            pos = match.end()
        self._pos = pos
        if pieces:
            events.append("".join(pieces))
        return False


def _without_layout(json_text: str) -> str:
    """``json_text`` without the whitespace outside its strings."""
    kept: list[str] = []
    in_string = escaped = False
    for char in json_text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char.isspace():
            continue
        else:
            in_string = char == '"'
        kept.append(char)
    return "".join(kept)


def _lone_high_surrogate(escape: re.Match[str]) -> bool:
    """Whether ``escape`` is a ``\\u`` escape of a high surrogate without its pair (yet)."""
    code = escape.group(0)
    return len(code) == 6 and code[1] == "u" and 0xD800 <= int(code[2:], 16) <= 0xDBFF
