"""The OpenAI-compatible API of the real server, through the official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from runtime.server import ServerProcess
from tests.tool_fixtures import parameters_by_name, time_tool, weather_tool

pytestmark = pytest.mark.timeout(300)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = weather_tool(12, description="Current weather of a city.")
TIME_TOOL = time_tool({"type": "string", "maxLength": 6})


def _native(server: ServerProcess, body: dict) -> dict:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60.0).json()


def test_completions_equal_native(client: openai.OpenAI, model: str, server: ServerProcess):
    prompt = "def fibonacci(n):"
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    native = _native(
        server,
        {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 10}},
    )
    assert completion.choices[0].text == native["text"]
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 10
    assert completion.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]


def test_chat_stream_equals_non_stream(client: openai.OpenAI, model: str):
    options = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(model=model, messages=MESSAGES, **options)
    assert full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **options,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_n_choices(client: openai.OpenAI, model: str):
    options = {"max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    two = client.chat.completions.create(model=model, messages=MESSAGES, n=2, seed=3, **options)
    one = client.chat.completions.create(model=model, messages=MESSAGES, seed=3, **options)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in two.choices)
    assert two.choices[0].message.content == one.choices[0].message.content  # same seed
    assert two.usage.completion_tokens == 12
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once


def test_logprobs(client: openai.OpenAI, model: str):
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: chosen is top
        assert isinstance(entry.bytes, list)
    raw = bytes(b for e in content for b in e.bytes)
    assert raw.decode(errors="replace") == chat.choices[0].message.content
    completion = client.completions.create(
        model=model, prompt="x = ", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_response_format_json_schema(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)


def test_strict_mode_validate_through_the_openai_client(client: openai.OpenAI, model: str):
    """A schema exact mode refuses (uniqueItems over unlisted items) is served under
    strict_mode "validate"; one no output can satisfy ends in a 422 naming the schema, streamed
    or not."""
    tags = {"type": "array", "items": {"type": "string", "pattern": "^[a-h]$"}, "maxItems": 3}
    unique = {**tags, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": unique}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=40, response_format=fmt
        )
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, response_format=fmt, seed=1,
        extra_body={"strict_mode": "validate", "validation_attempts": 16},
    )  # fmt: skip
    if response.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(response.choices[0].message.content), unique)
    impossible = {"type": "array", "items": {"type": "string", "pattern": "^a$"}, "minItems": 2}
    impossible["maxItems"] = 2
    impossible["uniqueItems"] = True
    bad = {"type": "json_schema", "json_schema": {"name": "none", "schema": impossible}}
    for stream in (False, True):
        with pytest.raises(openai.UnprocessableEntityError, match="no output satisfied"):
            reply = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=40, response_format=bad,
                stream=stream, extra_body={"strict_mode": "validate"},
            )  # fmt: skip
            if stream:
                list(reply)  # type: ignore[arg-type]


def test_tool_choice_required(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    schemas = parameters_by_name([WEATHER_TOOL, TIME_TOOL])
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_named_single_call(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert response.choices[0].finish_reason == "tool_calls"
    calls = response.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    for call in calls:
        jsonschema.validate(
            json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"]
        )


def test_tools_auto_is_unconstrained(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        max_tokens=8,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert choice.message.content is not None or choice.message.tool_calls


def test_errors_have_openai_shape(client: openai.OpenAI, model: str):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, extra_body={"mirostat": 2}
        )
    assert unknown.value.body["param"] == "mirostat"
    with pytest.raises(openai.BadRequestError) as bad_temperature:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=-1)
    assert bad_temperature.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as no_tools:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, tool_choice="required"
        )
    assert no_tools.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=2,
            response_format={"type": "json_object"},
            extra_body={"regex": "[a-z]+"},
        )
