"""The complete part of a JSON object that was cut off: what a tool call's arguments say so far
when ``max_tokens`` ends them mid-way.

``complete_prefix_object('{"city": "Paris", "unit": "cel')`` is ``{"city": "Paris"}``: every
member of the object whose value was written whole is kept, and the member being written is
dropped, whatever its type (a string, number, array or object cut mid-way would read as a
different value). Text that does not start an object gives ``{}``.
"""

from __future__ import annotations

import json
from typing import Any

_CLOSERS = {"{": "}", "[": "]"}
_SCALAR_END = set(",}] \t\r\n")


def _cut_points(text: str) -> list[tuple[int, str]]:
    """(end, closers) after each member value of the outer object written whole, in order:
    ``text[:end] + closers`` is then a complete JSON document."""
    points: list[tuple[int, str]] = []
    stack: list[str] = []
    # Per open object: whether the next string is a key (True) or a value.
    expect_key: list[bool] = []
    i, n = 0, len(text)

    def closers() -> str:
        return "".join(_CLOSERS[c] for c in reversed(stack))

    while i < n:
        c = text[i]
        if c in " \t\r\n,:":
            if c == "," and stack and stack[-1] == "{":
                expect_key[-1] = True
            elif c == ":" and stack and stack[-1] == "{":
                expect_key[-1] = False
            i += 1
            continue
        if c in "{[":
            stack.append(c)
            if c == "{":
                expect_key.append(True)
            i += 1
            continue
        if c in "}]":
            if not stack:
                break
            if stack.pop() == "{":
                expect_key.pop()
            i += 1
            if len(stack) <= 1:
                points.append((i, closers()))
            if not stack:
                break
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                break  # cut inside the string
            is_key = bool(stack) and stack[-1] == "{" and expect_key[-1]
            i = j + 1
            if not is_key and len(stack) == 1:
                points.append((i, closers()))
            continue
        # A number or a literal: whole only once a delimiter follows it.
        j = i
        while j < n and text[j] not in _SCALAR_END:
            j += 1
        if j >= n:
            break
        i = j
        if len(stack) == 1:
            points.append((i, closers()))
    return points


def complete_prefix_object(text: str) -> dict[str, Any]:
    """The object ``text`` begins, holding only what was written whole (see the module)."""
    start = text.lstrip()
    if not start.startswith("{"):
        return {}
    for end, closers in reversed(_cut_points(start)):
        try:
            value = json.loads(start[:end] + closers)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}
