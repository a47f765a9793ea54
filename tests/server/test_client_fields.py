"""The request fields today's OpenAI clients send (issue 52), through the real server and the
``openai`` client: the caller's fields (``prompt_cache_key``, ``safety_identifier``, ``user``,
``metadata``, ``store``, ``service_tier``), ``verbosity``, ``reasoning_effort`` without a
reasoning parser, the legacy ``functions`` / ``function_call`` round trip, and the 400 that
names each field a request gets wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from transformers import AutoTokenizer

from runtime.server import ServerProcess
from tests.tool_fixtures import time_tool, weather_tool

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "What time is it in Paris?"}]
# Bounded so the random-weight model finishes its call within max_tokens.
TIME_FUNCTION = time_tool({"type": "string", "maxLength": 4})["function"]
CALLER = {
    "prompt_cache_key": "session-42",
    "safety_identifier": "user-hash-1",
    "user": "user-1",
    "metadata": {"team": "agents", "run": "7"},
    "service_tier": "auto",
}


def test_chat_accepts_the_callers_fields(client: openai.OpenAI, model: str) -> None:
    """Every field is sent the way the client sends it (no extra_body); service_tier is
    echoed in the body and in every chunk (auto resolved to default, as OpenAI does)."""
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    fields = CALLER | {"store": False, "verbosity": "low"}
    reply = client.chat.completions.create(**request, **fields)
    assert reply.service_tier == "default"
    assert reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**request, **fields, stream=True))
    assert chunks and all(chunk.service_tier == "default" for chunk in chunks)
    plain = client.chat.completions.create(**request)
    assert plain.service_tier is None  # not asked, not answered
    flex = client.chat.completions.create(**request, service_tier="flex")
    assert flex.service_tier == "flex"


def test_completions_accept_the_callers_fields(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body=CALLER)
    assert reply.choices[0].finish_reason == "length"


def test_responses_echo_the_callers_fields(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model,
        input="Hello",
        max_output_tokens=16,
        text={"verbosity": "high"},
        **CALLER,
    )
    assert response.status in ("completed", "incomplete")
    assert response.prompt_cache_key == CALLER["prompt_cache_key"]
    assert response.safety_identifier == CALLER["safety_identifier"]
    assert response.user == CALLER["user"]
    assert response.metadata == CALLER["metadata"]
    assert response.service_tier == "default"
    assert response.text is not None and response.text.verbosity == "high"


def test_prompt_cache_retention_pins_the_prompt(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """``prompt_cache_retention`` pins the prompt's KV in the radix cache after the turn,
    in chat completions and Responses alike (issue 55); without it nothing is pinned. (Other
    tests' pins may expire meanwhile, so the counts are bounds.)"""
    before = server.server_info()["num_kv_pins"]
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert server.server_info()["num_kv_pins"] <= before
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Keep this conversation."}],
        max_tokens=1,
        extra_body={"prompt_cache_retention": "24h"},
    )
    assert reply.usage is not None
    chat = server.server_info()
    assert chat["num_kv_pins"] >= 1
    assert chat["kv_pinned_tokens"] >= reply.usage.prompt_tokens - 1
    response = client.responses.create(
        model=model,
        input="Keep this response's prompt, a longer one than the chat's to tell them apart.",
        max_output_tokens=16,
        extra_body={"prompt_cache_retention": "in-memory"},
    )
    assert response.usage is not None
    info = server.server_info()  # the two prompts share the template's first tokens
    assert info["num_kv_pins"] >= 2
    assert info["kv_pinned_tokens"] >= response.usage.input_tokens - 1


def test_a_turn_that_calls_a_tool_stays_pinned_for_the_tool_wait(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """A chat turn with tools that ends in a tool call keeps its prompt and output pinned
    (``--tool-wait-ttl``, 30 s by default) without being asked; a turn with tool_choice
    "none" (no tools shown) pins nothing."""
    tools = [{"type": "function", "function": TIME_FUNCTION}]
    request: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": tools}
    before = server.server_info()["num_kv_pins"]
    client.chat.completions.create(**request, tool_choice="none", max_tokens=1)
    assert server.server_info()["num_kv_pins"] <= before
    reply = client.chat.completions.create(
        **request, tool_choice="required", max_tokens=160, temperature=0
    )
    assert reply.choices[0].finish_reason == "tool_calls" and reply.usage is not None
    info = server.server_info()
    assert info["num_kv_pins"] >= 1
    assert info["kv_pinned_tokens"] >= reply.usage.total_tokens - 2


def test_a_turn_that_answers_in_text_is_not_pinned_for_the_tool_wait(
    server: ServerProcess, client: openai.OpenAI, model: str, tiny_model_path: Path
) -> None:
    """With tools on, a turn that stops of itself without a tool call (here: at its first
    token, the end of text) waits on no tool: nothing is pinned for it."""
    eos = AutoTokenizer.from_pretrained(tiny_model_path).eos_token_id
    tools = [{"type": "function", "function": TIME_FUNCTION}]
    before = server.server_info()["num_kv_pins"]
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say nothing at all, a turn never seen before."}],
        tools=tools,
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
        logit_bias={str(eos): 100},
    )
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    assert server.server_info()["num_kv_pins"] <= before


BAD_FIELDS = [
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"metadata": "team=agents"}, "metadata"),
    ({"prompt_cache_key": 42}, "prompt_cache_key"),
    ({"prompt_cache_key": "k" * 513}, "prompt_cache_key"),
    ({"safety_identifier": ["a"]}, "safety_identifier"),
    ({"user": 7}, "user"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"store": "yes"}, "store"),
    ({"verbosity": "loud"}, "verbosity"),
    ({"prompt_cache_retention": "1w"}, "prompt_cache_retention"),
    ({"functions": [{"name": ""}]}, "functions.0.name"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools.0.function.name"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"functions": {"name": "f"}}, "functions"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [{"name": "f"}], "tools": [{"function": {"name": "f"}}]}, "functions"),
    ({"functions": [{"name": "f"}], "tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}, {"name": "f"}]}, "functions"),
    ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages.0.name"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS)
def test_a_bad_field_is_a_400_naming_it(
    server: ServerProcess, model: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2} | fields
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"service_tier": "gold"}, "service_tier"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"prompt_cache_key": 42}, "prompt_cache_key"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ],
)
def test_a_bad_responses_field_is_a_400_naming_it(
    server: ServerProcess, model: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": model, "input": "Hello", "max_output_tokens": 2} | fields
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_reasoning_effort_without_a_reasoning_parser_is_openais_error(
    client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, reasoning_effort="low"
        )
    assert chat.value.code == "unsupported_parameter"
    assert chat.value.param == "reasoning_effort"
    assert "'reasoning_effort' is not supported with this model" in chat.value.message
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(
            model=model, input="Hello", max_output_tokens=2, reasoning={"effort": "none"}
        )
    assert responses.value.code == "unsupported_parameter"
    assert responses.value.param == "reasoning.effort"


def _legacy_stream(client: openai.OpenAI, **request: Any) -> tuple[str, str, str | None]:
    """(name, arguments, finish reason) of a streamed legacy call, checking the legacy delta
    shape: the name first with empty arguments, then argument fragments alone."""
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        assert choice.delta.tool_calls is None
        call = choice.delta.function_call
        if call is not None:
            if not name:
                assert call.name and call.arguments == ""
                name = call.name
            else:
                assert call.name is None
                arguments += call.arguments or ""
        finish = choice.finish_reason or finish
    return name, arguments, finish


def test_legacy_functions_round_trip(client: openai.OpenAI, model: str) -> None:
    """function_call naming a function: the call comes back as message.function_call with
    finish_reason "function_call" (streamed alike), and a conversation that sends the call and
    its ``function`` result back goes on."""
    request: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "functions": [TIME_FUNCTION],
        "function_call": {"name": "get_time"},
        "max_tokens": 160,
        "temperature": 0,
    }
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None and choice.message.content is None
    call = choice.message.function_call
    assert call is not None and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME_FUNCTION["parameters"])
    assert _legacy_stream(client, **request) == (call.name, call.arguments, "function_call")
    answered = [
        *MESSAGES,
        {"role": "assistant", "content": None, "function_call": call.model_dump()},
        {"role": "function", "name": "get_time", "content": "12:00"},
    ]
    follow_up = client.chat.completions.create(
        **(request | {"messages": answered, "function_call": "none", "max_tokens": 4})
    )
    assert follow_up.choices[0].finish_reason == "length"
    assert follow_up.choices[0].message.function_call is None


def test_legacy_functions_auto_answers_one_call_at_most(client: openai.OpenAI, model: str) -> None:
    """function_call "auto" (the default with functions) reads the output for one call: no
    tool_calls ever, and finish_reason "function_call" exactly when a call came back."""
    choice = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        functions=[TIME_FUNCTION, weather_tool(8)["function"]],
        max_tokens=24,
        temperature=0,
    ).choices[0]
    assert choice.message.tool_calls is None
    called = choice.message.function_call is not None
    assert (choice.finish_reason == "function_call") == called


# "type": "foo" is no JSON schema type: the tool's grammar cannot be built.
BAD_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "foo"}}}
BAD_FUNCTION = {"name": "get_time", "parameters": BAD_PARAMETERS}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (
            "chat/completions",
            {"tools": [{"type": "function", "function": BAD_FUNCTION}], "tool_choice": "required"},
            "tools",
        ),
        (
            "chat/completions",
            {"functions": [BAD_FUNCTION], "function_call": {"name": "get_time"}},
            "functions",
        ),
        (
            "responses",
            {"tools": [{"type": "function", **BAD_FUNCTION}], "tool_choice": "required"},
            "tools",
        ),
    ],
)
def test_an_invalid_tool_schema_names_the_tools(
    server: ServerProcess, model: str, path: str, fields: dict[str, Any], param: str
) -> None:
    """A parameters schema the grammar cannot compile is a 400 naming the tools (it named
    tool_choice)."""
    body = {"model": model, "max_tokens": 2, "messages": MESSAGES} | fields
    if path == "responses":
        body = {"model": model, "max_output_tokens": 2, "input": "Hello"} | fields
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "invalid JSON schema" in error["message"]
