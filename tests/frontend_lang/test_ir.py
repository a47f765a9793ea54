"""Expressions: gen's sampling params, constraints, typed values; concatenation; programs."""

from __future__ import annotations

import re

import pytest

import frontend_lang as fl
from frontend_lang.ir import DTYPE_REGEX, Gen, Seq, Text


def test_gen_maps_to_native_sampling_params():
    expr = fl.gen(
        "x",
        max_tokens=7,
        stop=["\n", "END"],
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        frequency_penalty=0.1,
        presence_penalty=0.2,
    )
    assert expr.sampling_params() == {
        "max_new_tokens": 7,
        "stop": ["\n", "END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
    }
    assert fl.gen("y").sampling_params() == {}  # the runtime's defaults
    assert fl.gen("c", choices=["a", "b"]).sampling_params() == {"choice": ["a", "b"]}
    assert fl.gen("n", dtype=int).sampling_params() == {"regex": DTYPE_REGEX[int]}


def test_json_schema_from_a_pydantic_model():
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    schema = fl.gen("city", json_schema=City).sampling_params()["json_schema"]
    assert schema["properties"]["population"]["type"] == "integer"


def test_one_constraint_at_most_and_valid_choices():
    with pytest.raises(ValueError, match="at most one of regex, json_schema"):
        fl.gen("x", regex="a", json_schema={"type": "string"})
    with pytest.raises(ValueError, match="dtype"):
        fl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="non-empty"):
        fl.select("x", choices=["a", ""])
    with pytest.raises(ValueError, match="needs choices"):
        fl.select("x")
    with pytest.raises(ValueError, match="choices_method"):
        fl.select("x", choices=["a"], choices_method="best")


@pytest.mark.parametrize(
    ("dtype", "text", "value"),
    [(int, "-42", -42), (float, "3.25", 3.25), (bool, "false", False), (str, '"hi"', "hi")],
)
def test_typed_gens_parse_their_regex_language(dtype: type, text: str, value: object):
    assert re.fullmatch(DTYPE_REGEX[dtype], text)
    assert Gen("v", dtype=dtype).parse(text) == value


def test_parse_refuses_cut_output():
    with pytest.raises(ValueError):
        Gen("v", json_schema={"type": "object"}).parse('{"a": ')
    with pytest.raises(ValueError):
        Gen("v", dtype=bool).parse("tru")


def test_plus_builds_a_flat_sequence():
    expr = "Q: " + fl.gen("q") + "\nA: " + fl.gen("a")
    assert isinstance(expr, Seq) and len(expr.parts) == 4
    assert expr.parts[0] == Text("Q: ") and expr.parts[2] == Text("\nA: ")
    with pytest.raises(TypeError, match="cannot append int"):
        fl.gen("x") + 3  # type: ignore[operator]


def test_function_needs_a_state_and_a_backend():
    with pytest.raises(TypeError, match="first parameter must be the state"):
        fl.function(lambda: None)

    @fl.function
    def prog(s: fl.ProgramState, topic: str) -> None:
        s += topic

    previous = fl.get_default_backend()
    fl.set_default_backend(None)
    try:
        with pytest.raises(ValueError, match="no backend"):
            prog.run(topic="x")
    finally:
        fl.set_default_backend(previous)
    with pytest.raises(TypeError, match="program 'prog'"):
        prog.run(topic="x", extra=1)


def test_gen_json_format():
    schema = {"type": "object"}
    expr = fl.gen("x", json_schema=schema, json_format="compact")
    assert expr.sampling_params() == {"json_schema": schema, "json_format": "compact"}
    assert "json_format" not in fl.gen("x", json_schema=schema).sampling_params()
    with pytest.raises(ValueError, match="json_format must be one of aligned, compact"):
        fl.gen("x", json_schema=schema, json_format="pretty")
    with pytest.raises(ValueError, match="json_format needs a json_schema"):
        fl.gen("x", json_format="compact")


def test_gen_passes_the_dry_fields_to_the_runtime():
    expr = fl.gen(
        "x",
        dry_multiplier=0.8,
        dry_allowed_length=3,
        dry_sequence_breakers=["\n"],
        dry_output_only=True,
    )
    assert expr.sampling_params() == {
        "dry_multiplier": 0.8,
        "dry_allowed_length": 3,
        "dry_sequence_breakers": ["\n"],
        "dry_output_only": True,
    }
    assert not any(name.startswith("dry_") for name in fl.gen("x").sampling_params())
