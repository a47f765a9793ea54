"""Checks a request passes before anything else reads it, shared by the HTTP API and the Engine.

Each defends a later stage that would fail on the input in a way that hurts more than one
request: nesting deep enough to exhaust Python's recursion (``json.loads``, the schema walkers),
lone surrogates that no UTF-8 encoder accepts (tokenizers, stop-string matching, ZMQ frames),
and token ids outside the vocabulary or int64 (embedding lookups, tensors).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, WithJsonSchema

from runtime.errors import RequestError

# Deepest JSON nesting a request body may have. Real bodies stay far below: a chat request
# with a tool whose parameters nest 30 objects deep is about 70 levels.
MAX_JSON_DEPTH = 256

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# A cache salt is an opaque tenant label: printable ASCII keeps it safe to log, to put in any
# header or key a later stage builds from it, and to compare byte for byte.
MAX_CACHE_SALT_LENGTH = 256
_CACHE_SALT = re.compile(rf"[\x20-\x7e]{{1,{MAX_CACHE_SALT_LENGTH}}}")

# A JSON string literal (with escapes): removed before bracket counting.
_STRING_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN_BRACKETS = (ord("["), ord("{"))
_CLOSE_BRACKETS = (ord("]"), ord("}"))


class InvalidRequestValue(RequestError):
    """A value a request may not hold (a 400); ``field`` is its dotted path
    (``messages.0.content``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


def json_nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw``, without parsing it (so a
    hostile body cannot exhaust the parser's recursion). Exact for valid JSON; for invalid
    JSON a number the parser's own error will make moot."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0 if not raw.strip() else _depth_of(raw)
    return _depth_of(raw)


def _depth_of(raw: bytes) -> int:
    import numpy as np  # here, not at the top: the DSL imports this module for its salt check

    codes = np.frombuffer(_STRING_LITERAL.sub(b'""', raw), dtype=np.uint8)
    steps = np.zeros(len(codes), dtype=np.int64)
    for code in _OPEN_BRACKETS:
        steps += codes == code
    for code in _CLOSE_BRACKETS:
        steps -= codes == code
    return int(np.cumsum(steps).max(initial=0))


def check_json_value(value: Any, field: str = "", max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise InvalidRequestValue if ``value`` (parsed JSON, or the Python equivalent) nests
    deeper than ``max_depth`` or holds a string or key with a lone surrogate. Iterative."""
    stack: list[tuple[Any, str, int]] = [(value, field, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                raise InvalidRequestValue(path, f"nests deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key, member in item.items():
                    if isinstance(key, str) and not _encodes(key):
                        raise InvalidRequestValue(path, "an object key holds a lone surrogate")
                    stack.append((member, _join(path, str(key)), depth + 1))
            else:
                stack.extend(
                    (member, _join(path, str(i)), depth + 1) for i, member in enumerate(item)
                )


def check_text(text: str, field: str) -> None:
    """Raise InvalidRequestValue unless ``text`` encodes as UTF-8 (no lone surrogates).
    ``field`` must itself encode (it goes into the error message)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestValue(
            field, f"holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}"
        ) from None


def _encodes(text: str) -> bool:
    try:
        check_text(text, "")
    except InvalidRequestValue:
        return False
    return True


def check_cache_salt(salt: object, field: str = "cache_salt") -> None:
    """Raise InvalidRequestValue naming ``field`` unless ``salt`` is None (no salt) or 1 to
    MAX_CACHE_SALT_LENGTH printable ASCII characters. Requests share cached KV only when their
    salts are equal (docs/serving.md, "Multi-tenant serving")."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise InvalidRequestValue(field, f"must be a string, got {type(salt).__name__}")
    problem = _cache_salt_problem(salt)
    if problem is not None:
        raise InvalidRequestValue(field, problem)


def _cache_salt_problem(salt: str) -> str | None:
    """Why the string ``salt`` is not a valid cache salt; None when it is one."""
    if _CACHE_SALT.fullmatch(salt) is not None:
        return None
    if len(salt) > MAX_CACHE_SALT_LENGTH:
        return f"must be at most {MAX_CACHE_SALT_LENGTH} characters, got {len(salt)}"
    if not salt:
        return "must not be empty (leave it out for no salt)"
    bad = next(c for c in salt if not " " <= c <= "~")
    return f"must be printable ASCII (U+0020 to U+007E); it holds U+{ord(bad):04X}"


def _valid_cache_salt(salt: str) -> str:
    problem = _cache_salt_problem(salt)
    if problem is not None:
        raise ValueError(problem)
    return salt


# ``cache_salt`` in the request models of every HTTP API (pydantic checks that it is a str;
# the schema states the rule for OpenAPI clients, the validator words the error).
CacheSalt = Annotated[
    str,
    AfterValidator(_valid_cache_salt),
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_CACHE_SALT_LENGTH,
            "pattern": "^[\\x20-\\x7e]+$",
            "description": "Share cached KV only with requests of the same salt.",
        }
    ),
]


def check_token_ids(ids: Sequence[Any], vocab_size: int, field: str) -> None:
    """Raise InvalidRequestValue unless every id is an integer (numpy's too) in
    [0, vocab_size)."""
    # The common case, a list of Python ints, in C-level passes; anything else (numpy ints,
    # bools, ...) or a bad id goes through the loop below, which names the offending id.
    if (
        isinstance(ids, list)
        and ids
        and set(map(type, ids)) == {int}
        and min(ids) >= 0
        and max(ids) < vocab_size
    ):
        return
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise InvalidRequestValue(field, f"token ids must be integers, got {token!r}")
        if not 0 <= int(token) < vocab_size:
            raise InvalidRequestValue(
                field, f"token id {token} at index {i} is outside the vocabulary [0, {vocab_size})"
            )


def check_output_room(
    prompt_tokens: int, max_tokens: int, context_length: int, field: str
) -> None:
    """Raise InvalidRequestValue naming ``field`` (the request's own ``max_tokens``, which it
    set: a default is cut to the room left) unless the prompt and ``max_tokens`` output tokens
    fit in the context, as OpenAI and vLLM refuse them: the request could never end as asked.
    ``context_length`` 0: not known yet, nothing checked."""
    if context_length and prompt_tokens + max_tokens > context_length:
        room = max(context_length - prompt_tokens, 0)
        raise InvalidRequestValue(
            field,
            f"the prompt's {prompt_tokens} tokens and {max_tokens} output tokens exceed the "
            f"context length of {context_length} tokens; ask for at most {room}",
        )


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def main_error(errors: Sequence[Any]) -> tuple[tuple[int | str, ...], str, str]:
    """(location, message, type) of the error to report from a pydantic ValidationError's
    ``errors()``: the first failing field's most specific error — the deepest (a union branch
    that matched the value's shape failed inside it), and of those one that is not a mere type
    mismatch. When every branch of a union fails on the value's type ("a string or a list"),
    the message names them all."""
    field = errors[0]["loc"][:1]
    mine = [e for e in errors if e["loc"][:1] == field]
    depth = max(len(e["loc"]) for e in mine)
    deepest = [e for e in mine if len(e["loc"]) == depth]
    chosen = next((e for e in deepest if not e["type"].endswith("_type")), None)
    if chosen is None and len(deepest) > 1:
        wanted = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in deepest)
        message = "Input should be " + " or ".join(wanted)
        return tuple(deepest[0]["loc"]), message, deepest[0]["type"]
    chosen = chosen or deepest[0]
    return tuple(chosen["loc"]), chosen["msg"], chosen["type"]
