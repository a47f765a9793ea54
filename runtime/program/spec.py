"""A program request: what ``POST /program`` and ``Engine.run_program`` take, parsed and checked.

JSON shape::

    {"program_id": "...",          # a later segment: continue this program (it must be held:
                                   #   else 404/410, never a new one); absent: a new program
     "branches": {"": [op, ...],   # ops per branch: "" is the program's root state; a fork
                  "/1.0": [...]},  #   branch is "<parent>/<fork id>.<index>"
     "stream": false,              # also send each gen's text as it is generated
     "end": false,                 # the program is over: release what it holds afterwards
     "cache_salt": "..."}          # optional: share cached KV only with requests of this salt;
                                   #   every segment of a program gives the same one

    op: {"type": "text", "text": "..."}
        {"type": "gen", "name": "x", "sampling_params": {...native names...}}
        {"type": "select", "name": "x", "choices": ["a", "b"], "choices_method": "..."}
        {"type": "fork", "id": 1, "branches": [[op, ...], [op, ...]]}
        {"type": "join", "id": 1}

A fork's id is unique within the program; its branches start when the parent reaches the fork
and run concurrently with it; ``join`` waits for them, and names a fork of this request or of
an earlier segment. Bad input raises RequestError (400) naming the field.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from runtime.errors import RequestError
from runtime.program.select_math import CHOICES_METHODS, TOKEN_LENGTH_NORMALIZED
from runtime.request_checks import check_cache_salt
from runtime.sampling_params import RequestLimits, SamplingParams

# Bounds that keep one request's work proportional to what it says.
MAX_OPS = 20_000
MAX_FORK_WIDTH = 256
MAX_DEPTH = 16
MAX_CHOICES = 1024


@dataclass(frozen=True)
class TextOp:
    text: str


@dataclass(frozen=True)
class GenOp:
    name: str | None
    params: SamplingParams


@dataclass(frozen=True)
class InvalidGen:
    """A gen whose sampling params are refused: it fails when the program reaches it (its
    branch's earlier ops run), as the interpreter's call would."""

    name: str | None
    message: str


@dataclass(frozen=True)
class SelectOp:
    name: str | None
    choices: tuple[str, ...]
    method: str


@dataclass(frozen=True)
class ForkOp:
    id: int
    branches: tuple[tuple[Op, ...], ...]


@dataclass(frozen=True)
class JoinOp:
    id: int


Op = TextOp | GenOp | InvalidGen | SelectOp | ForkOp | JoinOp


@dataclass(frozen=True)
class ProgramRequest:
    program_id: str | None
    branches: dict[str, tuple[Op, ...]]
    stream: bool
    end: bool
    cache_salt: str | None = None


def branch_key(parent: str, fork_id: int, index: int) -> str:
    """The name of branch ``index`` of fork ``fork_id`` started by branch ``parent``."""
    return f"{parent}/{fork_id}.{index}"


def parse_program(body: Any, limits: RequestLimits) -> ProgramRequest:
    """Check a program request; RequestError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("the program request must be a JSON object")
    unknown = set(body) - {"program_id", "branches", "stream", "end", "cache_salt"}
    if unknown:
        raise RequestError(f"{sorted(unknown)[0]}: unknown field", param=sorted(unknown)[0])
    program_id = body.get("program_id")
    if program_id is not None and (
        not isinstance(program_id, str) or not 0 < len(program_id) <= 128
    ):
        raise RequestError("program_id: must be a string of 1 to 128 characters")
    cache_salt = body.get("cache_salt")
    check_cache_salt(cache_salt)  # InvalidRequestValue, a RequestError naming the field
    stream, end = body.get("stream", False), body.get("end", False)
    for name, value in (("stream", stream), ("end", end)):
        if not isinstance(value, bool):
            raise RequestError(f"{name}: must be a boolean")
    raw = body.get("branches", {})
    if not isinstance(raw, dict):
        raise RequestError("branches: must be an object of op lists by branch name")
    counter = [0]
    branches: dict[str, tuple[Op, ...]] = {}
    for key, ops in raw.items():
        if key != "" and not key.startswith("/"):
            raise RequestError(f"branches: {key!r} is not a branch name ('' or '/<fork>.<i>')")
        branches[key] = _ops(ops, f"branches[{key!r}]", limits, counter, 0)
    if program_id is None:  # a new program: its first segment makes every fork it joins
        check_joins(branches, ())
    return ProgramRequest(program_id, branches, stream, end, cache_salt)


def check_joins(branches: dict[str, tuple[Op, ...]], forked: Collection[int]) -> None:
    """RequestError (400) naming the first join of a fork that neither ``branches`` nor the
    program's earlier segments (``forked``: their fork ids) make."""
    made = set(forked)
    joins: list[tuple[str, int]] = []

    def walk(ops: tuple[Op, ...], where: str) -> None:
        for i, op in enumerate(ops):
            if isinstance(op, ForkOp):
                made.add(op.id)
                for j, ops_j in enumerate(op.branches):
                    walk(ops_j, f"{where}[{i}].branches[{j}]")
            elif isinstance(op, JoinOp):
                joins.append((f"{where}[{i}]", op.id))

    for key, ops in branches.items():
        walk(ops, f"branches[{key!r}]")
    for where, fork_id in joins:
        if fork_id not in made:
            raise RequestError(f"{where}.id: the program has no fork with id {fork_id}")


def _ops(
    raw: Any, where: str, limits: RequestLimits, counter: list[int], depth: int
) -> tuple[Op, ...]:
    if not isinstance(raw, list):
        raise RequestError(f"{where}: must be a list of ops")
    if depth > MAX_DEPTH:
        raise RequestError(f"{where}: forks nest deeper than {MAX_DEPTH}")
    ops: list[Op] = []
    for i, item in enumerate(raw):
        counter[0] += 1
        if counter[0] > MAX_OPS:
            raise RequestError(f"the program has more than {MAX_OPS} ops")
        ops.append(_op(item, f"{where}[{i}]", limits, counter, depth))
    return tuple(ops)


def _op(raw: Any, where: str, limits: RequestLimits, counter: list[int], depth: int) -> Op:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise RequestError(f"{where}: an op is an object with a 'type'")
    kind = raw["type"]
    if kind == "text":
        _fields(raw, where, {"text"})
        text = raw.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}.text: must be a string")
        return TextOp(text)
    if kind == "gen":
        _fields(raw, where, {"name", "sampling_params"})
        name = _name(raw, where)
        try:
            params = SamplingParams.from_dict(raw.get("sampling_params"), limits)
        except ValueError as exc:
            return InvalidGen(name, str(exc))
        if params.n != 1:
            return InvalidGen(name, "sampling_params.n: a program's gen takes n = 1")
        return GenOp(name, params)
    if kind == "select":
        _fields(raw, where, {"name", "choices", "choices_method"})
        choices = raw.get("choices")
        if (
            not isinstance(choices, list)
            or not 0 < len(choices) <= MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise RequestError(f"{where}.choices: must be 1 to {MAX_CHOICES} non-empty strings")
        method = raw.get("choices_method", TOKEN_LENGTH_NORMALIZED)
        if method not in CHOICES_METHODS:
            raise RequestError(f"{where}.choices_method: must be one of {list(CHOICES_METHODS)}")
        return SelectOp(_name(raw, where), tuple(choices), method)
    if kind == "fork":
        _fields(raw, where, {"id", "branches"})
        fork_id = _fork_id(raw, where)
        branches = raw.get("branches")
        if not isinstance(branches, list) or not 0 < len(branches) <= MAX_FORK_WIDTH:
            raise RequestError(
                f"{where}.branches: must be a list of 1 to {MAX_FORK_WIDTH} op lists"
            )
        return ForkOp(
            fork_id,
            tuple(
                _ops(b, f"{where}.branches[{i}]", limits, counter, depth + 1)
                for i, b in enumerate(branches)
            ),
        )
    if kind == "join":
        _fields(raw, where, {"id"})
        return JoinOp(_fork_id(raw, where))
    raise RequestError(f"{where}.type: unknown op {kind!r} (text, gen, select, fork, join)")


def _fields(raw: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = set(raw) - allowed - {"type"}
    if extra:
        raise RequestError(f"{where}.{sorted(extra)[0]}: unknown field")


def _name(raw: dict[str, Any], where: str) -> str | None:
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{where}.name: must be a string or null")
    return name


def _fork_id(raw: dict[str, Any], where: str) -> int:
    value = raw.get("id")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise RequestError(f"{where}.id: must be an integer in [0, 2^31)")
    return value
