"""No object that copies its parent into itself: the guard beside a ``json_object`` grammar.

A small model asked for "a JSON object" can fall into a fixed point: inside the value of a
member (``"guests": [...]``) it writes an object that repeats the enclosing object from its
``{`` up to that same member (keys and values alike, at least one member before it), then
opens the same value again, and so on until
``max_tokens`` (SmolLM2-135M-Instruct does this on the quality benchmark's booking task:
``{"name": "Lian", ..., "guests": [{"name": "Lian", ..., "guests": [{...``). Once an object
has copied its parent's text up to the point where the parent opened the value that holds
it, opening a container there again can only start the next copy: greedy decoding has seen
the same text lead to the same step, and nothing in the copy can end it. JSON sets no depth
limit, so the grammar cannot refuse this; the guard follows the output's bytes beside it and
refuses, at exactly that point, the tokens that open an object or a list. The member's value
is then a scalar (a string, a number, ``true``, ``false`` or ``null``), and the output can
close.

The same guard bounds the other loop seen there, a list repeating one element (``"guests":
[{}, {}, {}, ...``): once the last ``REPEATS_BEFORE_CLOSE`` (3) elements of a list are equal
objects or lists, the list may only end (tokens that start with ``,`` are refused until
``]``), as the distinct-calls guard ends a list of calls. Lists of equal scalars
(``[0, 0, 0, 0]``) are data, not loops, and are left alone.

Objects are compared as written with the whitespace outside strings removed (so a copy in
another indentation is a copy). A token may finish the copy and open the container in one
piece (``": [{"``): while an object still reads as the start of its template, the tokens
whose bytes would do that are refused as well; likewise, while a list's element reads as the
start of an element that already repeated twice, tokens that close it and write ``,``
(``},``). Outputs that neither copy a parent this way nor repeat an element three times are
not changed. The guard only narrows the grammar's mask where the grammar allows something
else (a scalar always is, in a ``json_object`` value; so is ``]`` after an element).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grammar.distinct_calls import ScannedTokens, packed_without

_WHITESPACE = b" \t\n\r"
_OPENERS = b"{["
# A list whose last elements are this many equal objects or lists may only end.
REPEATS_BEFORE_CLOSE = 3
_CLOSE_THEN_SEPARATOR = re.compile(rb"[}\]][\s}\]]*,")
# The refusals of the last few template tails (the states a loop passes through again).
_CACHE_LIMIT = 64


@dataclass
class _Frame:
    """An open container: where its opening byte is in the canonical text; for an object, where
    its member value being written starts (-1: none) and its template, the text of the
    enclosing object up to the value that holds this one (None: no enclosing object)."""

    opener: int
    start: int
    value_start: int = -1
    members: int = 0  # for an object: members before the one being written
    template: bytes | None = None
    # For a list: where its element being written starts, its last element if that was an
    # object or a list, how many elements in a row ended equal to it, and whether it must end.
    element_start: int = -1
    last: bytes | None = None
    run: int = 0
    must_close: bool = False


@dataclass
class NestingScanner:
    """Reads a JSON value's bytes as they come and says where the innermost object stands
    against its template (``remaining``)."""

    canonical: bytearray = field(default_factory=bytearray)
    in_string: bool = False
    escaped: bool = False
    frames: list[_Frame] = field(default_factory=list)

    def feed(self, data: bytes) -> None:
        for byte in data:
            self._feed_byte(byte)

    def _feed_byte(self, byte: int) -> None:
        if self.in_string:
            self.canonical.append(byte)
            if self.escaped:
                self.escaped = False
            elif byte == ord("\\"):
                self.escaped = True
            elif byte == ord('"'):
                self.in_string = False
            return
        if byte in _WHITESPACE:
            return
        self.canonical.append(byte)
        top = self.frames[-1] if self.frames else None
        if byte == ord('"'):
            self.in_string = True
        elif byte == ord(":") and top is not None and top.opener == ord("{"):
            top.value_start = len(self.canonical)
        elif byte == ord(",") and top is not None and top.opener == ord("{"):
            top.value_start = -1
            top.members += 1
        elif byte == ord(",") and top is not None:
            if self.canonical[top.element_start : top.element_start + 1] not in (b"{", b"["):
                top.last, top.run = None, 0  # a scalar ends the run
            top.element_start, top.must_close = len(self.canonical), False
        elif byte in _OPENERS:
            start = len(self.canonical) - 1
            self.frames.append(_Frame(byte, start, template=self._template(byte)))
            if byte == ord("["):
                self.frames[-1].element_start = len(self.canonical)
        elif byte in b"}]" and self.frames:
            self.frames.pop()
            if self.frames and self.frames[-1].opener == ord("["):
                self._element_closed(self.frames[-1])

    def _element_closed(self, frame: _Frame) -> None:
        """An object or list that is an element of ``frame`` has closed."""
        element = bytes(self.canonical[frame.element_start :])
        frame.run = frame.run + 1 if element == frame.last else 1
        frame.last = element
        frame.must_close = frame.run >= REPEATS_BEFORE_CLOSE

    def _template(self, opener: int) -> bytes | None:
        """For a new object: the enclosing object's text from its ``{`` up to the start of the
        member value that holds the new one, if a whole member comes before that one (a copy
        must repeat a value: ``{"data": {"data": ...`` alone is no loop)."""
        if opener != ord("{"):
            return None
        for frame in reversed(self.frames):
            if frame.opener == ord("{"):
                if frame.value_start < 0 or frame.members == 0:
                    return None
                return bytes(self.canonical[frame.start : frame.value_start])
        return None

    def must_close_list(self) -> bool:
        """Whether the innermost container is a list whose last elements repeat one object or
        list ``REPEATS_BEFORE_CLOSE`` times: it may only end."""
        return bool(self.frames) and self.frames[-1].must_close

    def may_repeat(self) -> bool:
        """Whether an open list's element being written reads as the start of its last one,
        which repeated ``REPEATS_BEFORE_CLOSE - 1`` times: closing it could end the run."""
        return any(
            frame.opener == ord("[")
            and frame.last is not None
            and frame.run >= REPEATS_BEFORE_CLOSE - 1
            and frame.last.startswith(bytes(self.canonical[frame.element_start :]))
            for frame in self.frames
        )

    def remaining(self) -> bytes | None:
        """What the innermost object has left to write of its template before the point where
        opening a container is refused (b"": it is there), or None when it is not copying its
        template (or is not an object with one)."""
        if not self.frames:
            return None
        top = self.frames[-1]
        if top.template is None:
            return None
        written = bytes(self.canonical[top.start :])
        if not top.template.startswith(written):
            return None
        return top.template[len(written) :]


def _canonical(data: bytes, in_string: bool, escaped: bool) -> bytes:
    """``data``'s bytes without the whitespace outside strings, read from the given state."""
    out = bytearray()
    for byte in data:
        if in_string:
            out.append(byte)
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte not in _WHITESPACE:
            out.append(byte)
            in_string = byte == ord('"')
    return bytes(out)


class NestingGuard:
    """One request's guard: fed the tokens its matcher accepts, it narrows the grammar's mask
    where an object would open its template's container again. Not thread-safe, as the
    matcher it sits beside."""

    def __init__(self, vocabulary: NestingVocabulary) -> None:
        self._vocabulary = vocabulary
        self._scan = ScannedTokens(vocabulary.token_bytes, NestingScanner)

    def accepted(self, token_id: int) -> None:
        self._scan.accepted(token_id)

    def rolled_back(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` tokens (the scanner reads the rest again)."""
        self._scan.rolled_back(num_tokens)

    def _refused(self) -> frozenset[int]:
        scanner = self._scan.scanner
        if scanner.must_close_list():
            return self._vocabulary.separators
        refused = self._vocabulary.close_then_separator if scanner.may_repeat() else frozenset()
        remaining = scanner.remaining()
        if remaining is None:
            return refused
        return refused | self._vocabulary.refused(remaining, scanner.in_string, scanner.escaped)

    def refuses(self, token_id: int) -> bool:
        """Whether ``token_id`` is refused here (the grammar may still allow it)."""
        return token_id in self._refused()

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Narrows the filled ``bitmask[row]`` (packed int32 [words]) by the refused tokens,
        unless that would leave the grammar nothing to write."""
        refused = self._refused()
        if not refused:
            return
        words = bitmask[row]
        narrowed = words & self._vocabulary.packed_without(refused, words.shape[0])
        if bool((narrowed != 0).any()):
            words.copy_(narrowed)


class NestingVocabulary:
    """The vocabulary's bytes and, per template tail, the tokens that would finish it and open
    a container (built once per backend; only tokens that hold ``{`` or ``[`` can)."""

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self.token_bytes = token_bytes
        self._openers = [
            (i, data) for i, data in enumerate(token_bytes) if b"{" in data or b"[" in data
        ]
        self._longest = max((len(data) for _, data in self._openers), default=0)
        self.separators = frozenset(
            i for i, data in enumerate(token_bytes) if data.lstrip(_WHITESPACE)[:1] == b","
        )
        self.close_then_separator = frozenset(
            i for i, data in enumerate(token_bytes) if _CLOSE_THEN_SEPARATOR.search(data)
        )
        self._cache: dict[tuple[bytes, bool, bool], frozenset[int]] = {}
        self._masks: dict[tuple[frozenset[int], int], torch.Tensor] = {}
        self._masks_lock = threading.Lock()

    def packed_without(self, refused: frozenset[int], words: int) -> torch.Tensor:
        """The packed int32 mask [words] allowing every token but ``refused``, built once per
        refused set (a guard refuses the same few sets step after step; building one took
        0.08 ms for SmolLM2's 49K vocabulary on a quiet 2-core VM, 0.8 ms under load, on the
        scheduler thread; a cached one 0.02 ms a restrict). Shared by the backend's guards,
        read-only."""
        key = (refused, words)
        with self._masks_lock:
            mask = self._masks.get(key)
        if mask is None:
            mask = packed_without(sorted(refused), words)
            with self._masks_lock:
                if len(self._masks) >= _CACHE_LIMIT:
                    self._masks.pop(next(iter(self._masks)))
                self._masks[key] = mask
        return mask

    def refused(self, remaining: bytes, in_string: bool, escaped: bool) -> frozenset[int]:
        """The tokens whose bytes, read from this state, write ``remaining`` and then open an
        object or a list."""
        if len(remaining) >= self._longest:
            return frozenset()
        key = (remaining, in_string, escaped)
        found = self._cache.get(key)
        if found is None:
            found = frozenset(
                token_id
                for token_id, data in self._openers
                if _opens_after(_canonical(data, in_string, escaped), remaining)
            )
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = found
        return found


def _opens_after(written: bytes, remaining: bytes) -> bool:
    return (
        len(written) > len(remaining)
        and written.startswith(remaining)
        and written[len(remaining)] in _OPENERS
    )
