"""strict_mode "validate": schemas with keywords no automaton enforces compile their
enforceable part, every returned output validates against the whole schema, and a request
that finds none in its attempts fails alone with a 422 (issue 16)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest

from grammar import output_validator
from grammar.validate import ValidationPool, ValidationTimeout
from runtime import Engine
from runtime.errors import RequestError

PROMPT = "Reply in the requested format:"
# Two to three distinct letters: the grammar enforces the shape, not the distinctness (items
# with listed values, an enum, would be enforced exactly: test_schema_automata.py).
UNIQUE = {
    "type": "array",
    "items": {"type": "string", "pattern": "^[a-f]$"},
    "minItems": 2,
    "maxItems": 3,
    "uniqueItems": True,
}
# Unsatisfiable: two distinct items from one value.
IMPOSSIBLE = {
    "type": "array",
    "items": {"type": "string", "pattern": "^a$"},
    "minItems": 2,
    "maxItems": 2,
    "uniqueItems": True,
}
# The grammar forces forty a's and "!"; checking "not" then backtracks about 2^40 steps.
BACKTRACKS = {"type": "string", "pattern": "^a{40}!$", "not": {"pattern": "^(a+)+b"}}


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


def test_a_check_that_backtracks_fails_its_request_alone_in_bounded_time(tiny_model_path: Path):
    with Engine(
        tiny_model_path, max_total_tokens=4096, schema_validation_timeout=1.0
    ) as eng:  # fmt: skip
        start = time.monotonic()
        with pytest.raises(RequestError, match="took over 1 s") as err:
            eng.generate(PROMPT, _params(0, json_schema=BACKTRACKS, strict_mode="validate",
                                         max_new_tokens=64))  # fmt: skip
        assert err.value.status_code == 400 and err.value.param == "json_schema"
        assert time.monotonic() - start < 30
        # The killed checker is replaced: the next validated request is checked as usual.
        quick = {**BACKTRACKS, "pattern": "^a{3}!$"}
        result = eng.generate(PROMPT, _params(1, json_schema=quick, strict_mode="validate"))
        assert result["text"] == '"aaa!"' and result["meta_info"]["validation_attempts"] == 1


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


def test_multiple_of_is_decided_on_exact_decimals():
    """0.07 is a multiple of 0.01 (Python's float division says 7.000000000000001)."""
    check = output_validator({"type": "number", "multipleOf": 0.01})
    assert check("0.07") is None and check("4.6") is None and check("3") is None
    assert "multipleOf" in check("0.071")  # type: ignore[operator]
    assert output_validator({"multipleOf": 3})("7.5") is not None


def test_the_checker_pool_kills_an_overrunning_check_and_goes_on():
    pool = ValidationPool(workers=1, timeout=1.0)
    schema = json.dumps({"type": "string", "not": {"pattern": "^(a+)+b"}})
    try:
        assert "not" in pool.check(schema, json.dumps("aab"))  # type: ignore[operator]
        start = time.monotonic()
        with pytest.raises(ValidationTimeout, match="took over 1 s"):
            pool.check(schema, json.dumps("a" * 40 + "!"))
        assert time.monotonic() - start < 5
        assert pool.check(schema, json.dumps("aa")) is None  # on a fresh worker
        with pytest.raises(ValueError, match="cannot be checked"):
            pool.check(json.dumps({"$ref": "https://example.com/x"}), "1")
        assert pool.check(schema, json.dumps(7)) is not None  # that worker was kept
    finally:
        pool.shutdown()
