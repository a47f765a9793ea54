"""The expressions a program appends to its state: text, ``gen``, ``select`` and role blocks.

Expressions are inert values; the interpreter gives them meaning against a state and a backend.
``a + b`` concatenates expressions (and strings) into one sequence, so
``s += "Q: " + fl.gen("q", stop="\\n")`` reads as it would in the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# select's methods (the runtime's compiled select scores with the same code).
from runtime.dsl_api import CHOICES_METHODS, JSON_FORMATS, TOKEN_LENGTH_NORMALIZED

ROLES = ("system", "user", "assistant")


# The regex a typed gen is constrained to; its text is parsed back with the type.
DTYPE_REGEX: dict[type, str] = {
    int: r"-?(0|[1-9][0-9]{0,17})",
    float: r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?",
    bool: r"(true|false)",
    str: r'"[^"\\\n]{0,256}"',
}


class Expr:
    """Base of all expressions; ``+`` builds a Seq."""

    def __add__(self, other: Expr | str) -> Seq:
        return Seq((*_parts(self), *_parts(as_expr(other))))

    def __radd__(self, other: str) -> Seq:
        return Seq((*_parts(as_expr(other)), *_parts(self)))


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Seq(Expr):
    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable ``name``. Fields left None use the runtime's defaults."""

    name: str | None
    max_tokens: int | None = None
    stop: str | tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    choices: tuple[str, ...] | None = None
    dtype: type | None = None
    json_format: str | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    dry_output_only: bool | None = None

    def sampling_params(self) -> dict[str, Any]:
        """The runtime's native sampling params (SGLang names) for this gen."""
        params: dict[str, Any] = {}
        if self.max_tokens is not None:
            params["max_new_tokens"] = self.max_tokens
        for name in (
            "stop",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "regex",
            "json_schema",
            "json_format",
            *DRY_FIELDS,
        ):
            value = getattr(self, name)
            if value is not None:
                params[name] = list(value) if isinstance(value, tuple) else value
        if self.choices is not None:
            params["choice"] = list(self.choices)
        if self.dtype is not None:
            params["regex"] = DTYPE_REGEX[self.dtype]
        return params

    def parse(self, text: str) -> Any:
        """The value a caller reads back: the dtype's value, the JSON object, or the text.
        Raises ValueError when constrained output does not parse (e.g. cut at max_tokens)."""
        if self.dtype is bool:
            if text not in ("true", "false"):
                raise ValueError(f"expected true or false, got {text!r}")
            return text == "true"
        if self.dtype is str:
            return json.loads(text)
        if self.dtype is not None:
            return self.dtype(text)
        if self.json_schema is not None:
            return json.loads(text)
        return text


# gen's fields for the runtime's DRY repetition penalty, sent under their own names.
DRY_FIELDS = tuple(field.name for field in fields(Gen) if field.name.startswith("dry_"))


@dataclass(frozen=True)
class Select(Expr):
    """Choose one of ``choices`` by its likelihood after the current text."""

    name: str | None
    choices: tuple[str, ...]
    choices_method: str = TOKEN_LENGTH_NORMALIZED


@dataclass(frozen=True)
class Role(Expr):
    """A role block: ``content`` (if any) between the chat template's role header and footer."""

    role: str
    content: Expr | None = None


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use str or fl.gen")


def _parts(expr: Expr) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, Seq) else (expr,)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    regex: str | None = None,
    json_schema: dict[str, Any] | str | type | None = None,
    choices: list[str] | None = None,
    dtype: type | None = None,
    json_format: str | None = None,
    dry_multiplier: float | None = None,
    dry_base: float | None = None,
    dry_allowed_length: int | None = None,
    dry_penalty_last_n: int | None = None,
    dry_sequence_breakers: list[str] | None = None,
    dry_output_only: bool | None = None,
) -> Gen:
    """Generate into ``s[name]`` (the text). At most one constraint: ``regex``, ``json_schema``
    (a dict, a JSON string or a pydantic model class; ``s.parsed(name)`` is the object),
    ``choices`` or ``dtype`` (int, float, bool, str: the output is constrained to a literal of
    that type and ``s[name]`` is its value). ``json_format`` with ``json_schema``: "aligned"
    (the runtime's default: the whitespace a pretty-printer writes) or "compact". Constrained
    output that does not parse (cut short by max_tokens) raises ProgramError. The ``dry_*``
    fields set the runtime's DRY repetition penalty (docs/serving.md); the runtime checks
    them."""
    if hasattr(json_schema, "model_json_schema"):
        json_schema = json_schema.model_json_schema()  # type: ignore[union-attr]
    constraints = [n for n, v in _constraints(regex, json_schema, choices, dtype) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"gen({name!r}): give at most one of {', '.join(constraints)}")
    if dtype is not None and dtype not in DTYPE_REGEX:
        raise ValueError(f"gen({name!r}): dtype must be int, float, bool or str, got {dtype!r}")
    if choices is not None:
        _check_choices(name, choices)
    if json_format is not None:
        if json_format not in JSON_FORMATS:
            raise ValueError(
                f"gen({name!r}): json_format must be one of {', '.join(JSON_FORMATS)}, "
                f"got {json_format!r}"
            )
        if json_schema is None:
            raise ValueError(f"gen({name!r}): json_format needs a json_schema")
    return Gen(
        name,
        max_tokens,
        tuple(stop) if isinstance(stop, list) else stop,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        regex,
        json_schema,  # type: ignore[arg-type]
        tuple(choices) if choices is not None else None,
        dtype,
        json_format,
        dry_multiplier,
        dry_base,
        dry_allowed_length,
        dry_penalty_last_n,
        tuple(dry_sequence_breakers) if dry_sequence_breakers is not None else None,
        dry_output_only,
    )


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    choices_method: str = TOKEN_LENGTH_NORMALIZED,
) -> Select:
    """Append the most likely of ``choices`` and store it in ``s[name]``; its scores are in
    ``s.get_meta_info(name)``. ``choices_method``: one of CHOICES_METHODS."""
    if choices is None:
        raise ValueError(f"select({name!r}) needs choices")
    _check_choices(name, choices)
    if choices_method not in CHOICES_METHODS:
        raise ValueError(
            f"select({name!r}): choices_method must be one of {', '.join(CHOICES_METHODS)}"
        )
    return Select(name, tuple(choices), choices_method)


def system(content: Expr | str | None = None) -> Role:
    return Role("system", None if content is None else as_expr(content))


def user(content: Expr | str | None = None) -> Role:
    return Role("user", None if content is None else as_expr(content))


def assistant(content: Expr | str | None = None) -> Role:
    return Role("assistant", None if content is None else as_expr(content))


def _constraints(*values: Any) -> list[tuple[str, Any]]:
    return list(zip(("regex", "json_schema", "choices", "dtype"), values, strict=True))


def _check_choices(name: str | None, choices: list[str]) -> None:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{name!r}: choices must be a non-empty list of non-empty strings")
