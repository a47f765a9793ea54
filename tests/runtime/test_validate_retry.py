"""strict_mode "validate": schemas with keywords no automaton enforces compile their
enforceable part, every returned output validates against the whole schema, and a request
that finds none in its attempts fails alone with a 422 (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from grammar import output_validator
from runtime import Engine
from runtime.errors import RequestError

PROMPT = "Reply in the requested format:"
# Two to three distinct letters: the grammar enforces the shape, not the distinctness.
UNIQUE = {
    "type": "array",
    "items": {"enum": ["a", "b", "c", "d", "e", "f"]},
    "minItems": 2,
    "maxItems": 3,
    "uniqueItems": True,
}
# Unsatisfiable: two distinct items from one value.
IMPOSSIBLE = {
    "type": "array",
    "items": {"const": "a"},
    "minItems": 2,
    "maxItems": 2,
    "uniqueItems": True,
}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=16384, debug_invariants=True) as eng:
        yield eng


def _params(seed: int, **extra) -> dict:
    return {"temperature": 1.0, "seed": seed, "max_new_tokens": 48, **extra}


def test_exact_mode_refuses_and_validate_mode_returns_only_valid_outputs(engine: Engine):
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.generate(PROMPT, _params(0, json_schema=UNIQUE))
    attempts, exhausted = [], 0
    for seed in range(24):
        params = _params(seed, json_schema=UNIQUE, strict_mode="validate", validation_attempts=8)
        try:
            result = engine.generate(PROMPT, params)
        except RequestError as exc:  # the random model likes repeating itself
            assert exc.status_code == 422 and "uniqueItems" in str(exc)
            exhausted += 1
            continue
        meta = result["meta_info"]
        if meta["finish_reason"]["type"] == "length":
            continue
        jsonschema.validate(json.loads(result["text"]), UNIQUE)
        attempts.append(meta["validation_attempts"])
    assert len(attempts) >= 12 and exhausted <= 6
    assert max(attempts) > 1  # duplicates were drawn and drawn again
    assert min(attempts) == 1


def test_attempts_that_all_fail_end_in_a_422_for_that_request_alone(engine: Engine):
    with pytest.raises(RequestError, match="no output satisfied json_schema in 3 attempts") as err:
        engine.generate(PROMPT, _params(1, json_schema=IMPOSSIBLE, strict_mode="validate"))
    assert err.value.status_code == 422 and err.value.param == "json_schema"
    assert "uniqueItems" in str(err.value)
    ok = engine.generate(PROMPT, _params(2, max_new_tokens=4))
    assert ok["meta_info"]["completion_tokens"] == 4


def test_greedy_requests_get_one_attempt(engine: Engine):
    with pytest.raises(RequestError, match="in 1 attempt "):
        engine.generate(
            PROMPT,
            {"temperature": 0, "json_schema": IMPOSSIBLE, "strict_mode": "validate"},
        )


def test_the_server_default_applies_to_requests_that_choose_nothing(tiny_model_path: Path):
    with Engine(
        tiny_model_path, max_total_tokens=4096, schema_strict_mode="validate",
        schema_validation_attempts=2,
    ) as eng:  # fmt: skip
        with pytest.raises(RequestError, match="in 2 attempts"):
            eng.generate(PROMPT, _params(3, json_schema=IMPOSSIBLE))
        with pytest.raises(ValueError, match="uniqueItems"):  # a request may ask for exact
            eng.generate(PROMPT, _params(3, json_schema=IMPOSSIBLE, strict_mode="exact"))


def test_validate_needs_a_schema_and_bounded_attempts(engine: Engine):
    with pytest.raises(ValueError, match="strict_mode"):
        engine.generate(PROMPT, {"strict_mode": "validate", "regex": "a+"})
    with pytest.raises(ValueError, match="validation_attempts"):
        engine.generate(PROMPT, {"json_schema": UNIQUE, "validation_attempts": 99})
    with pytest.raises(ValueError, match="strict_mode"):
        engine.generate(PROMPT, {"json_schema": UNIQUE, "strict_mode": "loose"})


def test_the_validator_names_what_breaks():
    check = output_validator(UNIQUE)
    assert check('["a", "b"]') is None
    assert "uniqueItems" in check('["a", "a"]')  # type: ignore[operator]
    assert "not one JSON value" in check('["a"')  # type: ignore[operator]
    date = output_validator({"type": "string", "format": "date"})
    assert date('"2026-11-24"') is None
    assert "format" in date('"2026-13-45"')  # type: ignore[operator]
    nested = output_validator({"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    assert "/x" in nested('{"x": "s"}')  # type: ignore[operator]


def test_a_schema_the_validator_cannot_evaluate_is_the_requests_fault():
    dangling = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": {"list": {"type": "array", "items": {"$dynamicRef": "#meta"}}},
        "$ref": "#/$defs/list",
    }
    check = output_validator(dangling)
    with pytest.raises(ValueError, match="cannot be checked"):
        check("[1]")
    with pytest.raises(ValueError):  # the Engine names it: "json_schema is not valid JSON"
        output_validator("{not json")
