"""Constrained gens (regex, json_schema, choices, dtype) always give valid output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import frontend_lang as fl

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["Record:", "def f():", "Person #2 ->"]


@fl.function
def constrained(s: fl.ProgramState, prompt: str) -> None:
    s += prompt + "\nphone: " + fl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=16)
    s += "\nperson: " + fl.gen("person", json_schema=PERSON, max_tokens=64, temperature=0.0)
    s += "\ncolor: " + fl.gen("color", choices=["red", "green", "blue"])
    s += "\ncount: " + fl.gen("count", dtype=int, max_tokens=8)
    s += "\nok: " + fl.gen("ok", dtype=bool, max_tokens=4)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_constrained_gens_are_always_valid(backend: fl.Backend, prompt: str):
    state = constrained.run(prompt=prompt, backend=backend)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])
    person = state.parsed("person")
    jsonschema.validate(person, PERSON)
    assert json.loads(state["person"]) == person
    assert state["color"] in ("red", "green", "blue")
    assert isinstance(state["count"], int) and isinstance(state["ok"], bool)


def test_run_batch_of_json_extractions(backend: fl.Backend):
    @fl.function
    def extract(s: fl.ProgramState, text: str) -> None:
        s += f"Text: {text}\nJSON: " + fl.gen("out", json_schema=PERSON, max_tokens=64)

    texts = [f"person number {i}" for i in range(4)]
    states = extract.run_batch([{"text": t} for t in texts], backend=backend)
    for state, text in zip(states, texts, strict=True):
        assert state.text().startswith(f"Text: {text}\n")
        jsonschema.validate(state.parsed("out"), PERSON)
