"""Follows the JSON object of one tool call as its text arrives, character by character.

Only the object's own members are parsed: the string value of ``"name"`` and the span of the
arguments member (``"arguments"`` or ``"parameters"``, whichever comes first), so a parser can
announce a call as soon as its name is known and pass the arguments on as the model writes
them. Nested values are followed by bracket depth and string state alone; ``json.loads``
checks the whole object once it is closed (``result``).
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_STRUCTURAL = '{}[]":,'


class CallScanner:
    """One JSON object, fed from its opening ``{``.

    After each ``feed``: ``done`` once the object has closed, ``error`` once its top level
    cannot be JSON; ``name`` (a string) once the "name" member's value has been read
    (``bad_name`` if that value is not a string); ``args_start`` once the arguments value has
    begun and ``args_end`` once it has ended (offsets into ``text``); ``first_key`` once the
    first member's key has been read.
    """

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self.error = False
        self.name: str | None = None
        self.bad_name = False
        self.first_key: str | None = None
        self.args_key: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._state = "begin"  # begin, first_key, key, colon, value, string, scalar, nested, comma
        self._token_start = 0  # where the key or value being read starts
        self._key: str | None = None

    def feed(self, text: str) -> int:
        """Read ``text``; return how many of its characters belong to the object (all of them
        unless it closed or broke inside ``text``)."""
        start = len(self.text)
        self.text += text
        for pos in range(start, len(self.text)):
            if self.done or self.error:
                self.text = self.text[:pos]
                return pos - start
            self._step(self.text[pos], pos)
        return len(text)

    def arguments_text(self, skip: int = 0) -> str:
        """The arguments value as written so far ("" before it begins), less its first
        ``skip`` characters."""
        if self.args_start is None:
            return ""
        end = self.args_end if self.args_end is not None else len(self.text)
        return self.text[self.args_start + skip : end]

    def result(self) -> tuple[str, str] | None:
        """(name, arguments text) of a closed object that is a call: valid JSON, a string name,
        an object as arguments ("{}" when there is no arguments member); None otherwise."""
        if not self.done or self.error or self.name is None:
            return None
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") != self.name:
            return None
        if self.args_key is None:
            return self.name, "{}"
        arguments = self.arguments_text()
        parsed = value.get(self.args_key)
        # A repeated key makes json.loads keep the last value, not the span read here.
        if not isinstance(parsed, dict) or json.loads(arguments) != parsed:
            return None
        return self.name, arguments

    def _step(self, char: str, pos: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(pos)
            return
        if self._depth >= 2:
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_end(pos + 1)
            return
        self._top_level(char, pos)

    def _top_level(self, char: str, pos: int) -> None:
        state = self._state
        if state == "begin":
            if char != "{":
                self.error = True
            self._depth, self._state = 1, "first_key"
        elif char in _WHITESPACE:
            if state == "scalar":
                self._value_end(pos)
        elif state in ("first_key", "key"):
            if char == '"':
                self._in_string, self._token_start = True, pos
            elif char == "}" and state == "first_key":
                self._close()
            else:
                self.error = True
        elif state == "colon":
            self._state = "value"
            self.error = char != ":"
        elif state == "value":
            self._value_start(char, pos)
        elif state == "scalar":
            if char in ",}":
                self._value_end(pos)
                self._top_level(char, pos)
            elif char in _STRUCTURAL:
                self.error = True
        elif state == "comma":
            if char == ",":
                self._state = "key"
            elif char == "}":
                self._close()
            else:
                self.error = True

    def _value_start(self, char: str, pos: int) -> None:
        self._token_start = pos
        if self._key in ARGUMENT_KEYS and self.args_key is None:
            self.args_key, self.args_start = self._key, pos
        if char == '"':
            self._in_string, self._state = True, "string"
        elif char in "{[":
            self._depth, self._state = 2, "nested"
        elif char in _STRUCTURAL:
            self.error = True
        else:
            self._state = "scalar"

    def _string_closed(self, pos: int) -> None:
        if self._state in ("first_key", "key"):
            try:
                self._key = json.loads(self.text[self._token_start : pos + 1])
            except json.JSONDecodeError:
                self.error = True
            if self._state == "first_key":
                self.first_key = self._key
            self._state = "colon"
        else:
            self._value_end(pos + 1)

    def _value_end(self, end: int) -> None:
        self._state = "comma"
        if self._key == "name" and self.name is None and not self.bad_name:
            try:
                value = json.loads(self.text[self._token_start : end])
            except json.JSONDecodeError:
                value = None
            if isinstance(value, str):
                self.name = value
            else:
                self.bad_name = True
        if self._token_start == self.args_start:
            self.args_end = end

    def _close(self) -> None:
        self._depth, self.done = 0, True
