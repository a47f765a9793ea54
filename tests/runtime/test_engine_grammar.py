"""Constrained decoding through the Engine: every output parses and validates, errors stay local."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from runtime import Engine
from tests.grammar.ebnf_reference import ARITHMETIC_EBNF, parse_arithmetic
from tests.grammar.schema_corpus import SCHEMAS, validate_output
from tests.tool_fixtures import weather_tool

SEEDS = (0, 1, 2)
PROMPT = "Reply in the requested format:"


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    with Engine(tiny_model_path, max_total_tokens=32768, debug_invariants=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def closing_bias(engine: Engine) -> dict[str, float]:
    """A user-level logit_bias toward closing quotes/brackets, so a random model finishes;
    the grammar mask alone decides validity."""
    tok = engine.tokenizer
    ids = [t for t in range(len(tok)) if any(c in tok.decode([t]) for c in '"]}')]
    return {str(t): 4.0 for t in ids}


def _params(seed: int, bias: dict[str, float], **constraint) -> dict:
    return {
        "temperature": 1.0,
        "seed": seed,
        "max_new_tokens": 128,
        "logit_bias": bias,
        **constraint,
    }


def test_schema_corpus_always_validates(engine: Engine, closing_bias):
    assert len(SCHEMAS) >= 40
    requests = [(name, schema, seed) for name, schema in SCHEMAS for seed in SEEDS]
    results = engine.generate(
        [PROMPT] * len(requests),
        [_params(seed, closing_bias, json_schema=schema) for _, schema, seed in requests],
    )
    finished = 0
    for (name, schema, seed), result in zip(requests, results, strict=True):
        reason = result["meta_info"]["finish_reason"]
        if reason["type"] != "stop":
            assert reason["type"] == "length"
            continue
        finished += 1
        try:
            validate_output(schema, result["text"])
        except (ValueError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{name} seed {seed}: {result['text']!r} is invalid: {exc}")
    assert finished >= 0.9 * len(requests), f"only {finished} of {len(requests)} finished"
    engine.check_invariants()


def test_schema_as_json_string_and_length_cut(engine: Engine):
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    params = {"json_schema": json.dumps(schema), "max_new_tokens": 3, "temperature": 0}
    out = engine.generate(PROMPT, params | {"json_format": "compact"})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert '{"note":"'.startswith(out["text"])  # a cut-off prefix of valid compact output


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"]
)
def test_regex_outputs_fullmatch(engine: Engine, pattern: str):
    results = engine.generate(
        [PROMPT] * 4,
        [{"regex": pattern, "temperature": 1.0, "seed": s, "max_new_tokens": 48} for s in range(4)],
    )
    for result in results:
        assert result["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(pattern, result["text"]), result["text"]


def test_ebnf_outputs_parse_with_an_independent_parser(engine: Engine):
    results = engine.generate(
        [PROMPT] * 8,
        [
            {"ebnf": ARITHMETIC_EBNF, "temperature": 1.0, "seed": s, "max_new_tokens": 96}
            for s in range(8)
        ],
    )
    done = [r for r in results if r["meta_info"]["finish_reason"]["type"] == "stop"]
    assert len(done) >= 2  # a random model rarely ends a recursive grammar; validity is the point
    for result in done:
        parse_arithmetic(result["text"])


def test_choices_return_one_of_them(engine: Engine):
    choices = ["alpha", "beta gamma", "delta"]
    results = engine.generate(
        [PROMPT] * 5, [{"choice": choices, "temperature": 1.0, "seed": s} for s in range(5)]
    )
    assert all(r["text"] in choices for r in results)


def test_tool_calls_structural_form(engine: Engine, closing_bias):
    tools = [weather_tool(10, units=None, closed=False)]
    tag = {"tools": tools, "mode": "required", "name": None, "parallel": False}
    out = engine.generate(PROMPT, _params(0, closing_bias, structural_tag=tag))
    body = re.fullmatch(r"<tool_call>(.*)</tool_call>", out["text"], re.S)
    assert body, out["text"]
    call = json.loads(body.group(1))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], tools[0]["function"]["parameters"])


def test_constrained_and_free_requests_share_a_batch(engine: Engine):
    free = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    alone = engine.generate(PROMPT, free)["output_ids"]
    mixed = engine.generate([PROMPT, PROMPT], [{"regex": "[a-z]{5}", "temperature": 0}, free])
    assert re.fullmatch("[a-z]{5}", mixed[0]["text"])
    assert mixed[1]["output_ids"] == alone


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "number", "multipleOf": 0.0123, "maximum": 1e6}, "multipleOf"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "required"),
        ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "hostname"}, "format"),
    ],
)
def test_unsupported_schema_features_fail_that_request_alone(engine: Engine, schema, keyword):
    with pytest.raises(ValueError, match=keyword):
        engine.generate(PROMPT, {"json_schema": schema})
    relaxed = engine.generate(
        PROMPT, {"json_schema": schema, "grammar_best_effort": True, "max_new_tokens": 4}
    )
    assert relaxed["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_invalid_constraints_are_clear_errors(engine: Engine):
    with pytest.raises(ValueError, match="regex"):
        engine.generate(PROMPT, {"regex": "(unclosed"})
    with pytest.raises(ValueError, match="EBNF"):
        engine.generate(PROMPT, {"ebnf": "root ::= "})
    with pytest.raises(ValueError, match="one constraint"):
        engine.generate(PROMPT, {"regex": "a", "json_object": True})
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(PROMPT, {"stop_regex": "(?<=a)b"})


def test_compile_timeout_fails_only_that_request(tiny_model_path: Path):
    heavy = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "pattern": "[a-z]{2,40}[0-9]{1,30}"} for i in range(60)
        },
    }
    with Engine(tiny_model_path, max_total_tokens=4096, grammar_compile_timeout=0.01) as eng:
        free: dict = {}
        worker = threading.Thread(
            target=lambda: free.update(
                eng.generate(PROMPT, {"max_new_tokens": 30, "ignore_eos": True})
            )
        )
        worker.start()
        with pytest.raises(ValueError, match="longer than 0.01 s"):
            eng.generate(PROMPT, {"json_schema": heavy})
        worker.join(timeout=60)
        assert free["meta_info"]["completion_tokens"] == 30


def test_stop_regex_ends_and_trims(engine: Engine):
    free = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    text = engine.generate(PROMPT, free)["text"]
    word = re.search(r"[a-z]{3,}", text)
    assert word, text
    out = engine.generate(PROMPT, {**free, "stop_regex": [re.escape(word.group())]})
    assert out["text"] == text[: word.start()]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


FIXED_KEYS = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
        "preferred_communication_channel": {"enum": ["email", "telephone"]},
        "account_status_description": {"type": "string", "maxLength": 6},
    },
    "required": [
        "customer_identification_number",
        "preferred_communication_channel",
        "account_status_description",
    ],
}


@pytest.mark.parametrize("page_size", [1, 4])
def test_jump_forward_keeps_greedy_output_and_saves_steps(tiny_model_path: Path, page_size: int):
    params = {"json_schema": FIXED_KEYS, "temperature": 0, "max_new_tokens": 120}
    runs = {}
    for disabled in (True, False):
        with Engine(
            tiny_model_path,
            max_total_tokens=4096,
            page_size=page_size,
            disable_jump_forward=disabled,
            debug_invariants=True,
        ) as eng:
            outs = eng.generate([PROMPT, PROMPT + " again"], params)
            runs[disabled] = (outs, eng.get_server_info())
            eng.check_invariants()
    (off, off_info), (on, on_info) = runs[True], runs[False]
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    for out in on:
        validate_output(FIXED_KEYS, out["text"])
    assert on_info["draft_tokens_accepted"] > 20
    assert on_info["forward_steps"] < off_info["forward_steps"] - 10


def test_jump_forward_sampling_stays_valid_and_seeded(tiny_model_path: Path):
    """With the draft limit adapting to what the model accepts, drafts still verify under the
    sampling rule: outputs stay valid and reproducible for a seed."""
    params = [
        {"json_schema": FIXED_KEYS, "temperature": 1.0, "seed": s, "max_new_tokens": 120}
        for s in range(4)
    ]
    with Engine(tiny_model_path, max_total_tokens=4096, disable_jump_forward=False) as eng:
        first = eng.generate([PROMPT] * 4, params)
        second = eng.generate([PROMPT] * 4, params)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]
    for out in first:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            validate_output(FIXED_KEYS, out["text"])


def test_stop_string_inside_a_draft(tiny_model_path: Path):
    params = {
        "json_schema": FIXED_KEYS,
        "temperature": 0,
        "max_new_tokens": 120,
        "stop": ["communication"],
    }
    outs = []
    for disabled in (True, False):
        with Engine(
            tiny_model_path,
            max_total_tokens=4096,
            disable_jump_forward=disabled,
            debug_invariants=True,
        ) as eng:
            outs.append(eng.generate(PROMPT, params))
            eng.check_invariants()
    assert outs[0]["text"] == outs[1]["text"]
    assert outs[1]["text"].endswith('"preferred_')
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "communication"}


def test_min_new_tokens_yields_to_the_end_of_a_grammar(engine: Engine):
    out = engine.generate(PROMPT, {"choice": ["ok"], "min_new_tokens": 10, "temperature": 1.0})
    assert out["text"] == "ok"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_token_the_mask_allows_but_the_matcher_refuses_is_redrawn(tiny_model_path: Path):
    """xgrammar 0.2.8 lets ``\"\"\"\\n`` through the mask after ``{"\\"q\\"":"",`` (found by the
    fuzz suite); the sampler bans it and draws again, with and without jump-forward."""
    schema = {
        "type": "object",
        "properties": {'"q"': {"const": ""}},
        "required": ['"q"'],
        "additionalProperties": True,
    }
    # The state the fuzz suite found is compact JSON's.
    params = {"json_schema": schema, "max_new_tokens": 32, "seed": 0, "json_format": "compact"}
    for jump_forward_off in (False, True):
        with Engine(
            tiny_model_path, max_total_tokens=4096, disable_jump_forward=jump_forward_off
        ) as engine:
            out = engine.generate("The answer as JSON: ", params)
        assert out["text"].startswith('{"\\"q\\"":""')
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert json.loads(out["text"])['"q"'] == ""
