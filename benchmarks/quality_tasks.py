"""The quality benchmark's task sets and how an output is scored against an item's answer.

The sets live in ``benchmarks/data/quality/``: ``tasks.json`` gives each task's prompt template
and what constrains it (a JSON schema, a label set, or a tool), and ``<task>.jsonl`` its items,
each ``{"id", "text", "answer"}`` with the answer as field values. They are frozen: the
benchmark is tuned against nothing else, so they are never edited after results were seen.

Scoring is by field: a field is right when its normalized value equals the answer's
(``normalize``: case, surrounding whitespace and punctuation, and ``"34"`` versus ``34`` do not
count), an item is right when all its fields are. Validity is separate and strict: the output
parses and matches the task's schema (``jsonschema``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

DATA_DIR = Path(__file__).parent / "data" / "quality"
MIN_ITEMS = 30
KINDS = ("json", "label", "tool", "no_call")
# A no_call task's answer: whether the reply called a tool (the right move is not to).
NO_CALL_SCHEMA = {
    "type": "object",
    "properties": {"called": {"type": "boolean"}},
    "required": ["called"],
    "additionalProperties": False,
}
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_EDGE_PUNCTUATION = " \t\n.,;:!?'\""


@dataclass(frozen=True)
class Item:
    id: str
    text: str
    answer: dict[str, Any]


@dataclass(frozen=True)
class Task:
    """One task: ``kind`` "json" (answer with an object under ``schema``), "label" (answer
    ``field`` with one of ``labels``), "tool" (call ``tool``; the answer is its arguments) or
    "no_call" (``tool`` is offered but the right move is to answer: the answer is
    ``{"called": false}``, the value read ``{"called": <whether the reply called a tool>}``)."""

    name: str
    kind: str
    prompt: str
    items: tuple[Item, ...]
    schema: dict[str, Any] | None = None
    labels: tuple[str, ...] = ()
    field: str = ""
    tool: dict[str, Any] | None = None

    def user_message(self, item: Item) -> str:
        return self.prompt.replace("{text}", item.text)

    @property
    def output_schema(self) -> dict[str, Any]:
        """What a valid output matches: the object schema, the label enum, or the tool's
        parameters."""
        if self.kind == "label":
            return {"type": "string", "enum": list(self.labels)}
        if self.kind == "tool":
            assert self.tool is not None
            return dict(self.tool["parameters"])
        if self.kind == "no_call":
            return NO_CALL_SCHEMA
        assert self.schema is not None
        return self.schema


def load_tasks(names: list[str] | None = None, data_dir: Path = DATA_DIR) -> list[Task]:
    """The tasks of ``tasks.json`` (all, or ``names`` in that order) with their items.
    Raises ValueError naming the task for an unknown name or a malformed set."""
    specs: dict[str, dict[str, Any]] = json.loads((data_dir / "tasks.json").read_text())
    unknown = [n for n in names or [] if n not in specs]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; the tasks are {', '.join(specs)}")
    return [_task(name, specs[name], data_dir) for name in names or list(specs)]


def _task(name: str, spec: dict[str, Any], data_dir: Path) -> Task:
    if spec.get("kind") not in KINDS:
        raise ValueError(f"task {name}: kind must be one of {', '.join(KINDS)}")
    lines = (data_dir / f"{name}.jsonl").read_text().splitlines()
    items = tuple(Item(**json.loads(line)) for line in lines if line.strip())
    task = Task(
        name,
        spec["kind"],
        spec["prompt"],
        items,
        schema=spec.get("schema"),
        labels=tuple(spec.get("labels", ())),
        field=spec.get("field", ""),
        tool=spec.get("tool"),
    )
    _check(task)
    return task


def _check(task: Task) -> None:
    if len(task.items) < MIN_ITEMS:
        raise ValueError(f"task {task.name}: {len(task.items)} items, at least {MIN_ITEMS}")
    if "{text}" not in task.prompt:
        raise ValueError(f"task {task.name}: the prompt has no {{text}}")
    schema = task.output_schema
    for item in task.items:
        answer = item.answer.get(task.field) if task.kind == "label" else item.answer
        if not item.text or not item.answer:
            raise ValueError(f"task {task.name}: item {item.id} has no text or no answer")
        if not jsonschema.Draft202012Validator(schema).is_valid(answer):
            raise ValueError(f"task {task.name}: item {item.id}'s answer does not match its schema")
    if len({item.id for item in task.items}) != len(task.items):
        raise ValueError(f"task {task.name}: item ids repeat")


def normalize(value: Any) -> Any:
    """A value as compared with an answer: strings lower-cased, whitespace collapsed, edge
    punctuation dropped, and numerals (``"34"``, ``34``, ``34.0``) read as numbers."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = " ".join(value.split()).strip(_EDGE_PUNCTUATION).casefold()
        return float(text) if _NUMBER.fullmatch(text) else text
    return value


def find_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in free text (after prose, inside a code fence...), or None."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            pass
        else:
            if isinstance(value, dict):
                return value
        start = text.find("{", start + 1)
    return None


def tool_arguments(value: dict[str, Any] | None, tool_name: str) -> dict[str, Any] | None:
    """The arguments in a JSON object written as free text: a call written out as
    ``{"name": ..., "arguments"|"parameters": {...}}``, else the object itself."""
    if value is None:
        return None
    for key in ("arguments", "parameters"):
        inner = value.get(key)
        if isinstance(inner, dict) and value.get("name", tool_name) == tool_name:
            return inner
    return value


def read_label(text: str, labels: tuple[str, ...]) -> str | None:
    """The label a free answer gives: the output as a JSON string, else the one label named
    in it as a word (None when none is, or several are: a list of the labels is no answer)."""
    try:
        decoded = json.loads(text)
    except ValueError:
        decoded = None
    if isinstance(decoded, str) and normalize(decoded) in labels:
        return str(normalize(decoded))
    named = [label for label in labels if re.search(rf"\b{re.escape(label)}\b", text, re.I)]
    return named[0] if len(named) == 1 else None


def is_valid(value: Any, schema: dict[str, Any] | None) -> bool:
    """``value`` matches ``schema``; with no schema (``json_object``), it is an object."""
    if schema is None:
        return isinstance(value, dict)
    return value is not None and jsonschema.Draft202012Validator(schema).is_valid(value)


def fields_right(value: Any, answer: dict[str, Any]) -> int:
    """How many of the answer's fields ``value`` (an object) gets right."""
    if not isinstance(value, dict):
        return 0
    return sum(
        key in value and normalize(value[key]) == normalize(expected)
        for key, expected in answer.items()
    )
