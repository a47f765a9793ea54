"""``json_format`` on every API that constrains JSON: aligned by default, compact on request,
400s naming the field for bad values. A logit bias towards the newline token shows the layout:
under aligned the output takes newlines (each run bounded, so it still ends), under compact
it cannot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from runtime.server import ServerProcess

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "busy"]}},
    "required": ["ok", "mood"],
}
VALUE_KEYS = {"ok", "mood"}
TOOL = {
    "type": "function",
    "function": {"name": "set_mood", "parameters": SCHEMA},
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def newline_bias(tiny_model_path: Path) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer.encode("\n", add_special_tokens=False)
    assert len(ids) == 1
    return {str(ids[0]): 30.0}


def _check(text: str, fmt: str) -> None:
    assert set(json.loads(text)) == VALUE_KEYS
    if fmt == "aligned":
        assert "\n" in text
    else:
        assert not any(c.isspace() for c in text)


def _check_object(text: str, fmt: str) -> None:
    """Any JSON object (a random model may not finish one): its layout shows from the start."""
    assert text.startswith("{\n") == (fmt == "aligned")
    if fmt == "compact":
        assert "\n" not in text


def _native(server: ServerProcess, params: dict[str, Any]) -> httpx.Response:
    body = {"text": "JSON:", "sampling_params": {"temperature": 0, "max_new_tokens": 200} | params}
    return httpx.post(f"{server.url}/generate", json=body, timeout=300.0)  # first: warm-up


@pytest.mark.parametrize("fmt", [None, "aligned", "compact"])
def test_native_json_schema_and_object(
    server: ServerProcess, newline_bias: dict[str, float], fmt: str | None
) -> None:
    extra = {} if fmt is None else {"json_format": fmt}
    for constraint in ({"json_schema": SCHEMA}, {"json_object": True}):
        params = constraint | extra | {"logit_bias": newline_bias}
        response = _native(server, params)
        assert response.status_code == 200, response.text
        result = response.json()
        if "json_schema" in constraint:
            assert result["meta_info"]["finish_reason"]["type"] == "stop"
            _check(result["text"], fmt or "aligned")
        else:
            _check_object(result["text"], fmt or "aligned")
        assert "grammar_notes" not in result["meta_info"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"json_format": "pretty"}, "json_format"),
        ({"json_format": 1}, "json_format"),
        ({"grammar_max_whitespace": 65}, "grammar_max_whitespace"),
        ({"grammar_max_whitespace": -1}, "grammar_max_whitespace"),
        ({"json_format": "compact", "grammar_max_whitespace": 2}, "json_format"),
    ],
)
def test_native_bad_input(server: ServerProcess, params: dict[str, Any], field: str) -> None:
    response = _native(server, {"json_schema": SCHEMA} | params)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


@pytest.mark.parametrize("fmt", [None, "compact"])
def test_openai_response_formats(
    client: openai.OpenAI, model: str, newline_bias: dict[str, float], fmt: str | None
) -> None:
    extra = {} if fmt is None else {"json_format": fmt}
    schema_format = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA}}
    for response_format in (schema_format, {"type": "json_object"}):
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=200, temperature=0,
            logit_bias=newline_bias, response_format=response_format, extra_body=extra,
        )  # fmt: skip
        choice = chat.choices[0]
        text = choice.message.content or ""
        if response_format is schema_format:
            assert choice.finish_reason == "stop"
            _check(text, fmt or "aligned")
        else:
            _check_object(text, fmt or "aligned")
    completion = client.completions.create(
        model=model, prompt="JSON:", max_tokens=200, temperature=0, logit_bias=newline_bias,
        extra_body={"json_schema": json.dumps(SCHEMA)} | extra,
    )  # fmt: skip
    _check(completion.choices[0].text, fmt or "aligned")


@pytest.mark.parametrize("fmt", [None, "compact"])
def test_tool_call_arguments(
    client: openai.OpenAI, model: str, newline_bias: dict[str, float], fmt: str | None
) -> None:
    extra = {} if fmt is None else {"json_format": fmt}
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, temperature=0, logit_bias=newline_bias,
        tools=[TOOL], tool_choice="required", parallel_tool_calls=False, extra_body=extra,
    )  # fmt: skip
    calls = chat.choices[0].message.tool_calls
    assert calls and len(calls) == 1
    _check(calls[0].function.arguments, fmt or "aligned")


@pytest.mark.parametrize("fmt", [None, "compact"])
def test_responses_text_format(
    client: openai.OpenAI, model: str, newline_bias: dict[str, float], fmt: str | None
) -> None:
    extra: dict[str, Any] = {"logit_bias": newline_bias}
    if fmt is not None:
        extra["json_format"] = fmt
    response = client.responses.create(
        model=model, input="Answer in JSON.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "mood", "schema": SCHEMA}},
        extra_body=extra,
    )  # fmt: skip
    assert response.status == "completed"
    _check(response.output_text, fmt or "aligned")


def test_openai_and_responses_bad_json_format(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, response_format=fmt,
            extra_body={"json_format": "pretty"},
        )  # fmt: skip
    assert "json_format" in str(chat_error.value)
    with pytest.raises(openai.BadRequestError) as responses_error:
        client.responses.create(
            model=model, input="x", max_output_tokens=8,
            text={"format": {"type": "json_object"}}, extra_body={"json_format": "tabs"},
        )  # fmt: skip
    assert "json_format" in str(responses_error.value)


def test_json_object_cut_at_max_tokens_says_length(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """Only a cut output can fail to parse, and it says so (OpenAI's contract), on every API
    that takes json_object: chat's and the native finish_reason "length", the Responses API's
    "incomplete" for max_output_tokens."""
    for fmt in ("aligned", "compact"):
        native = _native(server, {"json_object": True, "json_format": fmt, "max_new_tokens": 2})
        assert native.json()["meta_info"]["finish_reason"]["type"] == "length"
        response = client.responses.create(
            model=model, input="Answer in JSON.", max_output_tokens=2, temperature=0,
            text={"format": {"type": "json_object"}}, extra_body={"json_format": fmt},
        )  # fmt: skip
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, temperature=0,
            response_format={"type": "json_object"}, extra_body={"json_format": fmt},
        )  # fmt: skip
        choice = chat.choices[0]
        assert choice.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice.message.content or "")
