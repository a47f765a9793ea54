"""Anthropic's Messages API through the real server and the ``anthropic`` client: an agent loop
with a tool round trip (streamed and not, the stream reassembled equal to the plain message),
stop reasons, ``count_tokens``, the API key in ``x-api-key``, errors in Anthropic's shape, and
with a reasoning parser the thinking block apart from a forced call or a schema's answer.

Tool calls are forced with ``tool_choice`` any / tool, so the tiny random-weight model makes
them (the grammar writes them; its plain template has no tool syntax, so the server uses the
generic format)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from runtime.chat.tool_calls import make_tool_parser
from runtime.chat.turn_reader import TurnReader
from runtime.errors import RequestError
from runtime.ipc import FinishReason
from runtime.server import ServerProcess
from runtime.server.http_app import ApiKeyMiddleware
from runtime.server.messages_run import MessageRun, new_message, stream_message
from runtime.server.messages_usage import split_usage
from runtime.server.state import caller_is_admin
from runtime.server.streams import Events
from runtime.tokenizer_manager import RequestOutput
from tests.server.server_process import API_KEY as KEY
from tests.server.test_server_reasoning import _sweep
from tests.tool_fixtures import weather_tool

pytestmark = pytest.mark.timeout(300)

WEATHER = weather_tool(8)["function"]
TOOL = {
    "name": WEATHER["name"],
    "description": "The weather in a city.",
    "input_schema": WEATHER["parameters"],
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The anthropic client no longer has sampling arguments; the server still reads them.
GREEDY = {"temperature": 0.0}
_CACHE = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    return keyed_server


@pytest.fixture(scope="module")
def client(claude: anthropic.Anthropic) -> anthropic.Anthropic:
    return claude


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    response = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}, timeout=10.0)
    return str(response.json()["data"][0]["id"])


def _without_ids(message: Any) -> list[dict[str, Any]]:
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


def _both(client: anthropic.Anthropic, **request: Any) -> Any:
    """The plain message of ``request``, after checking that the stream of the same request,
    reassembled by the client, is the same message (but for its ids)."""
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
        assert stream.response.headers["content-type"].startswith("text/event-stream")
    assert message.id.startswith("msg_") and streamed.id.startswith("msg_")
    assert _without_ids(streamed) == _without_ids(message)
    assert (streamed.stop_reason, streamed.stop_sequence) == (
        message.stop_reason,
        message.stop_sequence,
    )
    assert streamed.usage.output_tokens == message.usage.output_tokens
    return message


def test_agent_loop_with_a_tool_round_trip(client: anthropic.Anthropic, model: str) -> None:
    base = {"model": model, "max_tokens": 60, "extra_body": GREEDY, "tools": [TOOL]}
    first = _both(
        client, **base, messages=QUESTION, tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    assert calls and all(call.name == "get_weather" for call in calls)
    assert all(call.id.startswith("toolu_") for call in calls)
    for call in calls:
        jsonschema.validate(call.input, TOOL["input_schema"])
    history = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}
                for call in calls
            ],
        },
    ]
    second = _both(
        client, **(base | {"max_tokens": 6}), messages=history, tool_choice={"type": "auto"}
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The first turn's prompt and the calls the model wrote come back from the radix cache.
    usage = second.usage
    assert usage.cache_read_input_tokens > first.usage.input_tokens
    assert usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=model, messages=history, tools=[TOOL])
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


def test_any_tool_without_parallel_calls_makes_one(client: anthropic.Anthropic, model: str):
    message = _both(
        client,
        model=model,
        max_tokens=80,
        extra_body=GREEDY,
        tools=[TOOL],
        messages=QUESTION,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["tool_use"]


def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic, model: str) -> None:
    request = {"model": model, "extra_body": GREEDY, "messages": QUESTION, "system": "Be brief."}
    free = _both(client, **request, max_tokens=24)
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 24
    text = free.content[0].text
    at = next(i for i in range(4, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    stopped = _both(client, **request, max_tokens=24, stop_sequences=["\u2603", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:at]


def test_count_tokens_is_the_rendered_prompt(client: anthropic.Anthropic, model: str) -> None:
    plain = client.messages.count_tokens(model=model, messages=QUESTION).input_tokens
    with_tools = client.messages.count_tokens(model=model, messages=QUESTION, tools=[TOOL])
    assert with_tools.input_tokens > plain  # the generic format writes the tools into the prompt
    message = client.messages.create(model=model, max_tokens=1, messages=QUESTION)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == plain


def test_the_api_key_in_x_api_key_or_bearer(server: ServerProcess, model: str) -> None:
    body = {"model": model, "max_tokens": 1, "messages": QUESTION}
    url = f"{server.url}/v1/messages"
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        headers["anthropic-version"] = "2023-06-01"
        assert httpx.post(url, json=body, headers=headers, timeout=60.0).status_code == 200
    refused = httpx.post(url, json=body, headers={"x-api-key": "guess"}, timeout=10.0)
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect or missing API key"},
    }
    with anthropic.Anthropic(base_url=server.url, api_key="guess", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=model, max_tokens=1, messages=QUESTION)
    # Other APIs keep their own error shape.
    other = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10.0)
    assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"


def test_x_api_key_keeps_the_admin_key_apart() -> None:
    """With --admin-api-key, x-api-key is read like a Bearer token: the API key opens the
    Messages API and gets 403 (in Anthropic's shape there) on admin routes."""

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"admin": caller_is_admin(request)})

    paths = ["/v1/messages", "/flush_cache"]
    app = Starlette(routes=[Route(path, ok, methods=["POST"]) for path in paths])
    app.add_middleware(ApiKeyMiddleware, api_key="api", admin_api_key="admin")
    client = TestClient(app)

    def post(path: str, key: str) -> Any:
        response = client.post(path, headers={"x-api-key": key})
        return response.json() if response.status_code == 200 else response.status_code

    assert post("/v1/messages", "api") == {"admin": False}
    assert post("/v1/messages", "admin") == {"admin": True}
    assert post("/flush_cache", "admin") == {"admin": True}
    assert post("/flush_cache", "api") == 403
    assert post("/v1/messages", "guess") == 401
    refused = client.post("/v1/messages", headers={"x-api-key": "guess"}).json()
    assert refused["error"]["type"] == "authentication_error"


def _call_turn(call_id: str = "toolu_1") -> dict[str, Any]:
    block = {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {}}
    return {"role": "assistant", "content": [block]}


def _result_turn(call_id: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id}]}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
BAD_BODIES = [
    pytest.param({"max_tokens": None}, 400, "max_tokens", id="max_tokens-missing"),
    pytest.param({"max_tokens": 0}, 400, "max_tokens", id="max_tokens-zero"),
    pytest.param({"max_tokens": 2**64}, 400, "max_tokens", id="max_tokens-huge"),
    pytest.param({"max_tokens": "4"}, 400, "max_tokens", id="max_tokens-string"),
    pytest.param(
        {"max_tokens": 10**12}, 400, "max_tokens: the prompt's", id="max_tokens-past-the-context"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": []}]},
        400,
        "messages.0.content",
        id="empty-content-list",
    ),
    pytest.param(
        {"tools": [TOOL, TOOL]}, 400, "tools: tool names must be unique", id="duplicate-tools"
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "banana", "text": "x"}]}]},
        400,
        "messages.0.content",
        id="unknown-block",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [IMAGE]}]},
        400,
        "messages.0.content.0: image blocks are not supported",
        id="image",
    ),
    pytest.param(
        {"messages": [_call_turn(), _result_turn("toolu_2")]},
        400,
        "messages.1.content.0.tool_use_id",
        id="tool_result-without-its-tool_use",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": _call_turn()["content"]}]},
        400,
        "messages.0.content.0: a user message cannot hold tool_use",
        id="tool_use-in-a-user-turn",
    ),
    pytest.param(
        {"messages": [*QUESTION, {"role": "assistant", "content": "Sure "}]},
        400,
        "messages.1: final assistant content cannot end with trailing whitespace",
        id="prefill-with-trailing-whitespace",
    ),
    pytest.param(
        {
            "messages": [
                *QUESTION,
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
                {"role": "user", "content": "go on"},
            ]
        },
        400,
        "messages.1.content.0: thinking blocks need a server started with --reasoning-parser",
        id="thinking-block-without-a-parser",
    ),
    pytest.param(
        {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking", id="thinking"
    ),
    pytest.param(
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}},
        400,
        "tool_choice.name",
        id="unknown-tool",
    ),  # fmt: skip
    pytest.param({"tool_choice": {"type": "any"}}, 400, "tool_choice", id="any-without-tools"),
    pytest.param(  # "type": "foo" is no JSON schema type: the tool's grammar cannot be built
        {
            "tools": [{"name": "t", "input_schema": {"properties": {"a": {"type": "foo"}}}}],
            "tool_choice": {"type": "any"},
        },
        400,
        "tools: ",
        id="invalid-tool-schema",
    ),
    pytest.param(
        {
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": _CACHE | {"ttl": "2h"}}
            ]
        },
        400,
        "ttl",
        id="cache_control-ttl",
    ),
    pytest.param(
        {"tools": [TOOL | {"cache_control": {"type": "persistent"}}]},
        400,
        "cache_control.type",
        id="cache_control-type",
    ),
    pytest.param(
        {
            "messages": [
                *QUESTION,
                {
                    "role": "assistant",
                    "content": [{"type": "thinking", "thinking": "hm", "cache_control": _CACHE}],
                },
                {"role": "user", "content": "go on"},
            ]
        },
        400,
        "cache_control",
        id="cache_control-on-thinking",
    ),
    pytest.param({"top_k": 0}, 400, "top_k", id="top_k"),
    pytest.param({"temperature": 1.5}, 400, "temperature", id="temperature"),
    pytest.param({"frobnicate": 1}, 400, "frobnicate", id="unknown-field"),
    pytest.param({"model": "claude-opus"}, 404, "claude-opus", id="unknown-model"),
]


def test_a_tool_name_within_anthropics_bound_is_taken(
    client: anthropic.Anthropic, model: str
) -> None:
    """Anthropic names may be longer than OpenAI's 64 characters (a 500 once, found by the
    fuzzer)."""
    tool = TOOL | {"name": "t" * 100}
    counted = client.messages.count_tokens(model=model, messages=QUESTION, tools=[tool])
    assert counted.input_tokens > 0
    reply = client.messages.create(
        model=model, max_tokens=2, messages=QUESTION, tools=[tool], extra_body=GREEDY
    )
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")


@pytest.mark.parametrize(("change", "status", "named"), BAD_BODIES)
def test_bad_bodies_get_anthropic_errors(
    server: ServerProcess, model: str, change: dict[str, Any], status: int, named: str
) -> None:
    body = {"model": model, "max_tokens": 4, "messages": QUESTION} | change
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(
        f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30.0
    )
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    assert error["error"]["type"] == kind
    assert named in error["error"]["message"]


def _fed(pieces: list[str], reason: FinishReason) -> dict[str, Any]:
    """The message of a run fed ``pieces`` (the last finishing with ``reason``), tools on."""
    reader = TurnReader(make_tool_parser("generic", {"get_weather"}, None))
    run = MessageRun(new_message("m"), reader)
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        run.feed(
            RequestOutput(
                "r", text, piece, [0] * (i + 1), 5, i + 1, 0, reason if last else None, 0.0
            )
        )
    return run.message


def test_blocks_of_calls_and_of_a_call_cut_off() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"unit": "celsius"}}</tool_call>'
    whole = _fed(["  ", call[:30], call[30:], " \n"], FinishReason.stop(None))
    assert whole["content"] == [
        {"type": "tool_use", "id": whole["content"][0]["id"], "name": "get_weather",
         "input": {"unit": "celsius"}},
    ]  # fmt: skip
    assert whole["stop_reason"] == "tool_use"
    cut = _fed(["Let me see. ", call[:50]], FinishReason.cut(2))
    assert [block["type"] for block in cut["content"]] == ["text", "tool_use"]
    assert cut["content"][0]["text"] == "Let me see."
    assert cut["content"][1]["input"] == {} and cut["stop_reason"] == "max_tokens"
    # Cut inside the second argument: the first, written whole, is the input.
    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'
    partial = _fed([two], FinishReason.cut(2))
    assert partial["content"][0]["input"] == {"city": "Paris"}
    blank = _fed([" \n "], FinishReason.stop(2))  # whitespace alone: kept when it is all
    assert blank["content"] == [{"type": "text", "text": " \n "}]
    assert blank["stop_reason"] == "end_turn"


def test_a_failure_mid_stream_is_an_error_event() -> None:
    async def failing() -> Events:
        yield 0, RequestOutput("r", "Hi", "Hi", [5], 7, 1, 3, None, 0.0)
        raise RequestError("the scheduler refused it", status_code=400)

    async def body() -> list[bytes]:
        return [part async for part in stream_message(MessageRun(new_message("m")), failing())]

    events = [part.decode().split("\n") for part in asyncio.run(body())]
    assert [lines[0] for lines in events] == [
        "event: message_start",
        "event: ping",
        "event: content_block_start",
        "event: content_block_delta",
        "event: error",
    ]
    start = json.loads(events[0][1][len("data: ") :])
    usage = start["message"]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (4, 3)
    error = json.loads(events[-1][1][len("data: ") :])
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the scheduler refused it"},
    }


@pytest.fixture(scope="module")
def reasoning_server(r1_server: ServerProcess) -> ServerProcess:
    return r1_server


def test_thinking_stays_apart_from_a_forced_call_and_a_schema(
    reasoning_server: ServerProcess, thinking_model_path: Path
) -> None:
    """deepseek-r1: the output starts inside the reasoning; the forced call's input and the
    schema's answer come after it, in their own blocks."""
    tokenizer = AutoTokenizer.from_pretrained(thinking_model_path)
    end = str(tokenizer.convert_tokens_to_ids("</think>"))
    tool = {"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}
    prompt = tokenizer.apply_chat_template(  # as the server renders ``tool``
        QUESTION, tools=[weather_tool(8)], tokenize=False, add_generation_prompt=True
    )
    options, thinking = _sweep(reasoning_server, prompt, end, [{}], min_thinking=1)
    with anthropic.Anthropic(
        base_url=reasoning_server.url, api_key="unused", timeout=120.0, max_retries=0
    ) as client:
        model = client.models.list().data[0].id
        request = {"model": model, "messages": QUESTION, "extra_body": GREEDY | options}
        called = _both(
            client,
            **request,
            max_tokens=80,
            tools=[tool],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        )
        assert called.stop_reason == "tool_use", called
        assert [block.type for block in called.content] == ["thinking", "tool_use"]
        assert called.content[0].thinking == thinking.removesuffix("</think>")
        jsonschema.validate(called.content[1].input, tool["input_schema"])
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        sky = [{"role": "user", "content": "Is the sky blue?"}]
        plain_prompt = tokenizer.apply_chat_template(
            sky, tokenize=False, add_generation_prompt=True
        )
        options, thinking = _sweep(reasoning_server, plain_prompt, end, [{}], min_thinking=1)
        request |= {"messages": sky, "extra_body": GREEDY | options}
        answered = _both(
            client,
            **request,
            max_tokens=40,
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
        assert [block.type for block in answered.content] == ["thinking", "text"]
        assert answered.content[0].thinking == thinking.removesuffix("</think>")
        jsonschema.validate(json.loads(answered.content[1].text), schema)
        # The thinking goes back in the next turn, with the call's result.
        blocks = [b.model_dump(exclude_none=True) for b in called.content]
        history = [
            *QUESTION,
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": called.content[1].id, "content": "sunny"}
            ]},
        ]  # fmt: skip
        after = client.messages.create(model=model, max_tokens=2, messages=history, tools=[tool])
        assert after.usage.cache_read_input_tokens > 0


def test_cache_control_pins_the_prompt(
    client: anthropic.Anthropic, model: str, server: ServerProcess
) -> None:
    """A prompt marked with ``cache_control`` stays pinned in the radix cache after its turn
    (issue 55); one without stays unpinned."""
    before = server.server_info()["num_kv_pins"]  # other tests' tool-wait pins may expire
    client.messages.create(model=model, max_tokens=1, messages=QUESTION, extra_body=GREEDY)
    assert server.server_info()["num_kv_pins"] <= before
    marked = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Pin this.", "cache_control": _CACHE | {"ttl": "1h"}}
            ],
        }
    ]
    reply = client.messages.create(model=model, max_tokens=1, messages=marked, extra_body=GREEDY)
    info = server.server_info()
    usage = reply.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert info["kv_pinned_tokens"] >= prompt + (usage.cache_creation_input_tokens or 0) - 1
    assert info["num_kv_pins"] >= 1


def _marked_request(prefix: str, question: str) -> dict[str, Any]:
    """A request whose system prompt ``prefix`` is marked for caching (a breakpoint at its
    end), then an unmarked question."""
    return {
        "max_tokens": 1,
        "system": [{"type": "text", "text": prefix, "cache_control": _CACHE}],
        "messages": [{"role": "user", "content": question}],
        "extra_body": GREEDY,
    }


def test_usage_counts_the_marked_prefix_as_written_then_as_read(
    client: anthropic.Anthropic, model: str
) -> None:
    """Anthropic's usage: the first request writes the marked prefix
    (``cache_creation_input_tokens``), the next one with the same prefix reads it
    (``cache_read_input_tokens``); what follows the breakpoint is ``input_tokens``; the three
    add up to the prompt (``count_tokens``)."""
    prefix = "Notes on marked prefixes, never sent before by any test: " + "kiwi lime " * 40
    first_request = _marked_request(prefix, "First question?")
    first = client.messages.create(model=model, **first_request).usage
    counted = client.messages.count_tokens(
        model=model, system=first_request["system"], messages=first_request["messages"]
    ).input_tokens
    created = first.cache_creation_input_tokens or 0
    read = first.cache_read_input_tokens or 0
    assert created + read + first.input_tokens == counted
    assert created > 80 and read < created  # the system turn's shared start may be cached
    assert 0 < first.input_tokens < 30  # the question and the turn's markup
    second = client.messages.create(model=model, **_marked_request(prefix, "Another one?")).usage
    assert (second.cache_read_input_tokens or 0) >= created + read - 1
    assert (second.cache_creation_input_tokens or 0) <= 1
    plain = client.messages.create(
        model=model,
        max_tokens=1,
        system="An unmarked system prompt, never sent before: " + "fig plum " * 40,
        messages=[{"role": "user", "content": "First question?"}],
        extra_body=GREEDY,
    ).usage
    assert (plain.cache_creation_input_tokens or 0) == 0


def test_usage_split_adds_up_and_puts_the_breakpoint_first() -> None:
    assert split_usage(100, 0, 60) == {
        "input_tokens": 40, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 60
    }  # fmt: skip
    assert split_usage(100, 60, 60)["cache_creation_input_tokens"] == 0
    assert split_usage(100, 80, 60) == {
        "input_tokens": 20, "cache_read_input_tokens": 80, "cache_creation_input_tokens": 0
    }  # fmt: skip
    assert split_usage(100, 10, 0)["input_tokens"] == 90
