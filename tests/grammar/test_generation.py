"""Constrained generation with the tiny random model always satisfies the constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pydantic
import pytest
import torch

from grammar import GrammarOptions, GrammarService, GrammarSpec
from grammar.json_layout import INDENT_MAX
from runtime.chat.tool_calls import parse_tool_calls
from tests.grammar.decoder import ConstrainedDecoder, sample_random
from tests.grammar.ebnf_reference import ARITHMETIC_EBNF, parse_arithmetic
from tests.grammar.schema_corpus import SCHEMAS, validate_output
from tests.tool_fixtures import parameters_by_name, weather_tool

SEEDS = (0, 1, 2)
MAX_TOKENS = 128
BIAS = 4.0  # see decoder.py: helps a random model finish; the mask alone decides validity


def test_corpus_outputs_validate(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    assert len(SCHEMAS) >= 40
    finished = 0
    for name, schema in SCHEMAS:
        compiled = service.compile(GrammarSpec.for_json_schema(schema))
        results = decoder.generate([compiled] * len(SEEDS), SEEDS, MAX_TOKENS, 1.0, BIAS)
        for seed, result in zip(SEEDS, results, strict=True):
            if not result.terminated:
                continue
            finished += 1
            try:
                validate_output(schema, result.text)
            except (ValueError, jsonschema.ValidationError) as exc:
                pytest.fail(f"{name} seed {seed}: {result.text!r} is invalid: {exc}")
    assert finished >= 0.9 * len(SCHEMAS) * len(SEEDS), f"only {finished} outputs finished"


def test_pydantic_model_schema(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    class Item(pydantic.BaseModel):
        sku: str = pydantic.Field(pattern=r"^[A-Z]{3}[0-9]{2}$")
        count: int = pydantic.Field(ge=1, le=5)
        gift: bool | None = None

    compiled = service.compile(GrammarSpec.for_json_schema(Item))
    for result in decoder.generate([compiled] * 3, SEEDS, MAX_TOKENS, 1.0, BIAS):
        assert result.terminated
        Item.model_validate_json(result.text)


@pytest.mark.parametrize(
    "pattern",
    [
        r"[0-9]{3}-[0-9]{4}",
        r"(yes|no|maybe)!?",
        r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
        r"v\d+(\.\d{1,2})?",
        r"\S{2,5} \w",
        r"[^\n]{4}",
        r"\(\d{3}\) \d{3}",
    ],
)
def test_regex_outputs_fullmatch(
    pattern: str, decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    compiled = service.compile(GrammarSpec.for_regex(pattern))
    results = decoder.generate([compiled] * 4, range(4), 64, 1.0, BIAS)
    for result in results:
        if result.terminated:
            assert re.fullmatch(pattern, result.text), (pattern, result.text)
    assert sum(r.terminated for r in results) >= 3


def test_ebnf_outputs_parse(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    compiled = service.compile(GrammarSpec.for_ebnf(ARITHMETIC_EBNF))
    results = decoder.generate([compiled] * 6, range(6), 96, 1.0, BIAS)
    for result in results:
        if result.terminated:
            parse_arithmetic(result.text)
    assert sum(r.terminated for r in results) >= 4


def test_choice_returns_one_choice(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    choices = ["yes", "no", "yes, but", 'say "hi"\n', "ünïcode"]
    compiled = service.compile(GrammarSpec.for_choice(choices))
    seen = set()
    for result in decoder.generate([compiled] * 12, range(12), 32):
        assert result.terminated
        assert result.text in choices
        seen.add(result.text)
    assert len(seen) >= 2


def test_json_object_is_an_object(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    spec = GrammarSpec.from_sampling_params({"json_object": True})
    assert spec is not None
    compiled = service.compile(spec)
    results = decoder.generate([compiled] * 4, range(4), MAX_TOKENS, 1.0, BIAS)
    for result in results:
        if result.terminated:
            assert isinstance(json.loads(result.text), dict)
        # Aligned (the default), bounded: a cut-off output is still a JSON prefix whose
        # whitespace runs are at most a newline and INDENT_MAX indentation characters.
        assert not re.search(rf"\s{{{INDENT_MAX + 2}}}", result.text)
        assert not re.search(r"\n[ \t]*\n", result.text)


WEATHER = weather_tool(10, units=("C", "F"), closed=False)
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "$defs": {"q": {"type": "string", "pattern": "^[a-z ]{1,12}$"}},
            "type": "object",
            "properties": {
                "query": {"$ref": "#/$defs/q"},
                "top": {"type": "integer", "maximum": 9},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS_BY_NAME = parameters_by_name(TOOLS)
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes", "llama3", "mistral", "generic")


def _tool_calls(text: str) -> list[dict[str, Any]]:
    calls = CALL.findall(text)
    assert calls and "".join(f"<tool_call>{c}</tool_call>" for c in calls) == text, text
    parsed = [json.loads(c) for c in calls]
    for call in parsed:
        assert set(call) == {"name", "arguments"}
        jsonschema.validate(call["arguments"], SCHEMAS_BY_NAME[call["name"]])
    return parsed


def _parsed_calls(text: str, fmt: str) -> list[str]:
    """The names of the calls the server's parser finds in ``text``, every one of them valid
    under its tool's schema and nothing else in the text."""
    content, calls = parse_tool_calls(text, set(SCHEMAS_BY_NAME), fmt=fmt)
    assert content is None and calls, text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS_BY_NAME[call.name])
    return [call.name for call in calls]


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_calls_required(
    parallel: bool, decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    compiled = service.compile(GrammarSpec.for_tool_calls(TOOLS, "required", parallel=parallel))
    names = set()
    for result in decoder.generate([compiled] * 4, range(4), MAX_TOKENS, 1.0, BIAS):
        if result.terminated:
            calls = _tool_calls(result.text)
            assert parallel or len(calls) == 1
            names |= {c["name"] for c in calls}
    assert names


def test_tool_calls_named(decoder: ConstrainedDecoder, service: GrammarService) -> None:
    spec = GrammarSpec.for_tool_calls(TOOLS, "named", name="search", parallel=False)
    compiled = service.compile(spec)
    for result in decoder.generate([compiled] * 4, range(4), MAX_TOKENS, 1.0, BIAS):
        if result.terminated:
            assert [c["name"] for c in _tool_calls(result.text)] == ["search"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_call_formats_parse_back(
    fmt: str, parallel: bool, decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    """Each format's constrained output is what that format's parser reads as calls."""
    required = GrammarSpec.for_tool_calls(TOOLS, "required", parallel=parallel, format=fmt)
    named = GrammarSpec.for_tool_calls(TOOLS, "named", "search", parallel, format=fmt)
    grammars = [service.compile(required)] * 3 + [service.compile(named)] * 3
    results = decoder.generate(grammars, range(6), MAX_TOKENS, 1.0, BIAS)
    assert sum(r.terminated for r in results) >= 3
    for i, result in enumerate(results):
        if result.terminated:
            names = _parsed_calls(result.text, fmt)
            assert parallel or len(names) == 1
            assert i < 3 or set(names) == {"search"}


ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}},
    "required": ["verdict"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_or_answer(
    fmt: str, decoder: ConstrainedDecoder, service: GrammarService, tokenizer: Any
) -> None:
    """tool_choice auto with a response format: the answer is admitted, an answer outside
    the schema is not, and every sampled output is calls or a valid answer."""
    spec = GrammarSpec.for_tool_calls(TOOLS, "required", format=fmt, answer=ANSWER)
    compiled = service.compile(spec)

    def admits(text: str) -> bool:
        matcher = compiled.new_matcher()
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return all(matcher.accept_token(t) for t in ids)

    assert admits('{"verdict":"no"}') and not admits('{"verdict":"maybe"}')
    results = decoder.generate([compiled] * 8, range(8), MAX_TOKENS, 1.0, BIAS)
    kinds = set()
    for result in results:
        if not result.terminated:
            continue
        try:
            value = json.loads(result.text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and "verdict" in value:
            jsonschema.validate(value, ANSWER)
            kinds.add("answer")
        else:
            _parsed_calls(result.text, fmt)
            kinds.add("calls")
    assert kinds


def test_unconstrained_rows_are_untouched(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    compiled = service.compile(GrammarSpec.for_regex("[0-9]+"))
    matcher = compiled.new_matcher()
    logits = torch.randn(3, decoder.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    decoder.apply_masks(logits, [None, matcher, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(decoder.tokenizer.decode([t]).isdigit() for t in allowed)


def test_mixed_batch_with_unconstrained_sequence(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    schema = {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3}
    compiled = service.compile(GrammarSpec.for_json_schema(schema))
    constrained, free = decoder.generate([compiled, None], [0, 0], 48)
    assert constrained.terminated
    validate_output(schema, constrained.text)
    assert len(free.token_ids) > 0


def test_max_tokens_cut_is_not_terminated(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    compiled = service.compile(GrammarSpec.for_regex("a{50}"))
    (result,) = decoder.generate([compiled], [0], 5)
    assert not result.terminated and len(result.token_ids) == 5


def test_structural_tag_content_validates(
    decoder: ConstrainedDecoder, service: GrammarService
) -> None:
    inner = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "n": {"enum": [1, 2]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
            "k": {"type": "integer", "anyOf": [{"maximum": -1}, {"minimum": 1}]},
        },
        "required": ["city", "n", "tags", "k"],
    }  # with a value rule of ours and a combinator's siblings (merged, as for json_schema)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<answer>",
            "content": {"type": "json_schema", "json_schema": inner},
            "end": "</answer>",
        },
    }
    compiled = service.compile(GrammarSpec.for_structural_tag(tag))
    finished = 0
    for result in decoder.generate([compiled] * 4, range(4), 64, 1.0, BIAS):
        if result.terminated:
            finished += 1
            match = re.fullmatch(r"<answer>(.*)</answer>", result.text, re.DOTALL)
            assert match, result.text
            validate_output(inner, match.group(1))
    assert finished >= 2


def _whitespace_bias(decoder: ConstrainedDecoder) -> torch.Tensor:
    """+6 on every token made only of whitespace: a model that loves blanks."""
    bias = torch.zeros(decoder.vocab_size)
    for token in range(len(decoder.tokenizer)):
        text = decoder.tokenizer.decode([token])
        if text and not text.strip():
            bias[token] = 6.0
    return bias + 4.0 * decoder.closing


WHITESPACE_SCHEMA = {
    "type": "object",
    "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
        "ok": {"type": "boolean"},
        # Value rules of ours (schema_unique, schema_numbers) follow the whitespace setting too.
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True},
        "n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    },
    "required": ["xs", "ok", "tags", "n"],
}


def test_compact_json_has_no_whitespace(decoder: ConstrainedDecoder, backend: Any) -> None:
    options = GrammarOptions(json_format="compact")  # aligned is the default
    compiled = backend.compile(GrammarSpec.for_json_schema(WHITESPACE_SCHEMA, options))
    bias = _whitespace_bias(decoder)
    for seed in range(10):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 64, bias)
        text = decoder.tokenizer.decode(tokens[:-1] if done else tokens)
        assert not re.search(r"\s", text), text
        if done:
            validate_output(WHITESPACE_SCHEMA, text)


def test_aligned_whitespace_is_bounded(decoder: ConstrainedDecoder, backend: Any) -> None:
    """A model that loves blanks gets a pretty-printer's whitespace at most: one newline and
    at most INDENT_MAX indentation characters per run, one space after ":", none before "," or
    ":"; and it still finishes valid documents."""
    compiled = backend.compile(GrammarSpec.for_json_schema(WHITESPACE_SCHEMA))
    bias = _whitespace_bias(decoder)
    saw_newline = finished = False
    for seed in range(10):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 160, bias)
        text = decoder.tokenizer.decode(tokens[:-1] if done else tokens)
        assert not re.search(rf"\s{{{INDENT_MAX + 2}}}", text), text
        assert not re.search(r"\n[ \t]*\n|\s[,:]|:\s{2}|:\n|^\s", text), text
        saw_newline |= "\n" in text
        if done:
            finished = True
            validate_output(WHITESPACE_SCHEMA, text)
    assert saw_newline and finished


def test_whitespace_runs_are_capped(decoder: ConstrainedDecoder, backend: Any) -> None:
    options = GrammarOptions(max_whitespace=2)
    compiled = backend.compile(GrammarSpec.for_json_schema(WHITESPACE_SCHEMA, options))
    bias = _whitespace_bias(decoder)
    saw_whitespace = False
    for seed in range(10):
        tokens, done = sample_random(compiled, decoder.vocab_size, seed, 96, bias)
        text = decoder.tokenizer.decode(tokens[:-1] if done else tokens)
        assert not re.search(r"\s{3}", text), text
        saw_whitespace |= bool(re.search(r"\s", text))
        if done:
            validate_output(WHITESPACE_SCHEMA, text)
    assert saw_whitespace
