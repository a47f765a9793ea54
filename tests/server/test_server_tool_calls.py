"""Tool calls through the real server, for each test-model chat template and so each format
(the plain template has no tool syntax: the server uses the generic format):
tool_choice required / named / auto, parallel_tool_calls, streaming deltas, cut-off calls
(kept, as streamed, with finish_reason "length"),
and the cache hit of a conversation re-sent with its calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from transformers import AutoTokenizer

from runtime.chat.generic_tools import generic_messages
from runtime.server import ServerProcess
from runtime.server.token_text import TokenText
from runtime.test_model import CHAT_TEMPLATES, cached_test_model
from tests.server.server_process import POOL
from tests.tool_fixtures import parameters_by_name, responses_tool, time_tool, weather_tool

pytestmark = pytest.mark.timeout(300)

WEATHER_TOOL = weather_tool(8)
TIME_TOOL = time_tool({"type": "string", "maxLength": 4})
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = parameters_by_name(TOOLS)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
]
# template -> (format, two complete calls as that format writes them)
CALLS_TEXT = {
    "chatml": (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
    ),
    # No tool syntax in the template: the server describes the generic format itself.
    "plain": (
        "generic",
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
    ),
    "llama3": (
        "llama3",
        '{"name": "get_time", "parameters": {"zone": "UTC"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
    ),
    "mistral": (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
    ),
}


class ToolServer:
    """A server on one template's test model, with that model's tokenizer and a client."""

    def __init__(self, template: str, process: ServerProcess, path: Path) -> None:
        self.template = template
        self.process = process
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.client = openai.OpenAI(
            base_url=f"{process.url}/v1", api_key="unused", timeout=120.0, max_retries=0
        )
        self.model = self.client.models.list().data[0].id

    def chat(self, **options: Any) -> Any:
        options = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0} | options
        return self.client.chat.completions.create(model=self.model, **options)

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The conversation as the server renders it (generic: tools and calls in the
        messages, the template given no tools)."""
        if self.template == "plain":
            return str(
                self.tokenizer.apply_chat_template(
                    generic_messages(messages, TOOLS), tokenize=False
                )
            )
        return str(self.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False))

    def token_id(self, token: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def endless_bias(self) -> dict[str, float]:
        """Biases that keep constrained calls coming until max_tokens: every way to end the
        output (the stop tokens, and "]" that closes mistral's list) pushed far down."""
        text = TokenText(self.tokenizer)
        stops = {self.tokenizer.eos_token_id, self.token_id(CHAT_TEMPLATES[self.template].turn_end)}
        banned = stops | {i for i in range(len(self.tokenizer)) if "]" in text.text(i)}
        return {str(i): -100.0 for i in banned}


# One template per tool-call format (qwen3 writes chatml's calls; its tests are the reasoning
# ones).
@pytest.fixture(scope="module", params=sorted(CALLS_TEXT))
def tools_server(request: pytest.FixtureRequest) -> Iterator[ToolServer]:
    template = request.param
    if template == "chatml":  # the session's server already runs the chatml model
        process = request.getfixturevalue("server")
        yield ToolServer(template, process, request.getfixturevalue("tiny_model_path"))
        return
    path = cached_test_model("tiny", "llama", chat_template=template)
    process = ServerProcess(path, *POOL)
    try:
        process.wait_ready()
        yield ToolServer(template, process, path)
    finally:
        process.stop()


def _check_calls(calls: list[Any]) -> None:
    assert calls
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream(ts: ToolServer, **options: Any) -> tuple[str, dict[int, dict[str, Any]], str]:
    """(content, calls by index as a client assembles them, finish reason) of a streamed chat,
    checking the OpenAI delta shape: id, type and name first with empty arguments, then
    argument fragments with the index alone."""
    chunks = list(ts.chat(stream=True, **options))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls = "", {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.index == len(calls)
                assert piece.id.startswith("call_") and piece.type == "function"
                assert piece.function.name and piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["args"] += piece.function.arguments
    reasons = [chunk.choices[0].finish_reason for chunk in chunks]
    assert all(reason is None for reason in reasons[:-1])
    return content, calls, reasons[-1]


def test_the_format_comes_from_the_chat_template(tools_server: ToolServer):
    fmt = CALLS_TEXT[tools_server.template][0]
    assert tools_server.process.server_info()["tool_call_format"] == fmt


def test_required_calls_stream_like_the_whole_response(tools_server: ToolServer):
    options = {"tool_choice": "required", "max_tokens": 160}
    response = tools_server.chat(**options)
    choice = response.choices[0]
    assert choice.message.content is None
    calls = choice.message.tool_calls
    cut = choice.finish_reason == "length"  # max_tokens cut the last call: it is kept
    assert choice.finish_reason == "tool_calls" or response.usage.completion_tokens == 160
    _check_calls(calls[:-1] if cut else calls)
    content, streamed, reason = _stream(tools_server, **options)
    assert content == "" and reason == choice.finish_reason
    whole = [(c.function.name, c.function.arguments) for c in calls]
    assert [(c["name"], c["args"]) for c in streamed.values()] == whole


def test_parallel_false_is_exactly_one_call(tools_server: ToolServer):
    bias = tools_server.endless_bias()  # would make more calls if the grammar let it
    options = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 160}
    calls = tools_server.chat(**options).choices[0].message.tool_calls
    assert len(calls) == 1
    _check_calls(calls)
    named = tools_server.chat(
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=160,
        logit_bias={k: v for k, v in bias.items() if int(k) != tools_server.tokenizer.eos_token_id},
    )
    assert named.choices[0].finish_reason == "tool_calls"
    calls = named.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"]
    _check_calls(calls)


def test_a_call_cut_off_by_max_tokens_is_kept_as_streamed(tools_server: ToolServer):
    """tool_choice required, calls until max_tokens: never content next to the calls (the
    reported bug); the complete calls, and a call max_tokens cut inside with the arguments it
    had, as the stream sent it. The finish reason is "length" when a call was cut, else
    "tool_calls" (the cut fell between calls)."""
    options = {
        "tool_choice": "required",
        "max_tokens": 70,
        "logit_bias": tools_server.endless_bias(),
    }
    response = tools_server.chat(**options)
    choice = response.choices[0]
    assert response.usage.completion_tokens == 70
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert choice.finish_reason in ("length", "tool_calls")
    _check_calls(calls[:-1] if choice.finish_reason == "length" else calls)
    content, streamed, reason = _stream(tools_server, **options)
    assert content == "" and reason == choice.finish_reason
    whole = [(c.function.name, c.function.arguments) for c in calls]
    assert [(c["name"], c["args"]) for c in streamed.values()] == whole


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_finds_calls_in_free_text(tools_server: ToolServer, parallel: bool):
    fmt, calls_text = CALLS_TEXT[tools_server.template]
    intro = "" if fmt == "llama3" else "Sure. "  # llama3 calls are the whole turn
    # The regex extension makes the free output exactly this text.
    options = {
        "max_tokens": 200,
        "parallel_tool_calls": parallel,
        "extra_body": {"regex": re.escape(intro + calls_text)},
    }
    choice = tools_server.chat(**options).choices[0]
    assert choice.message.content == (intro.strip() or None)
    zones = [json.loads(c.function.arguments)["zone"] for c in choice.message.tool_calls]
    assert zones == (["UTC", "CET"] if parallel else ["UTC"])
    assert choice.finish_reason == "tool_calls"
    content, streamed, reason = _stream(tools_server, **options)
    assert content.strip() == intro.strip() and reason == "tool_calls"
    assert [json.loads(c["args"])["zone"] for c in streamed.values()] == zones


def test_auto_keeps_a_cut_off_call(tools_server: ToolServer):
    """A call max_tokens cuts inside its arguments is returned with what it had, as the
    stream sent it, and finish_reason "length"."""
    fmt, calls_text = CALLS_TEXT[tools_server.template]
    text = calls_text[: calls_text.index("UTC") + 3]  # inside the first call's arguments
    tokens = len(tools_server.tokenizer(text, add_special_tokens=False).input_ids)
    regex = {"regex": re.escape(calls_text)}
    # The model may spell the markup with more tokens than the tokenizer: cut a bit later
    # until the call has started.
    for max_tokens in range(tokens, tokens + 6):
        choice = tools_server.chat(max_tokens=max_tokens, extra_body=regex).choices[0]
        if choice.message.tool_calls:
            break
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert call.function.arguments.startswith("{") and not call.function.arguments.endswith("}")
    content, streamed, reason = _stream(tools_server, max_tokens=max_tokens, extra_body=regex)
    assert (content, reason) == ("", "length")
    assert [(c["name"], c["args"]) for c in streamed.values()] == [
        ("get_time", call.function.arguments)
    ]


def test_resent_calls_hit_the_cache(tools_server: ToolServer):
    """A client sends the conversation back with the assistant's calls and a tool result: the
    prompt's prefix up to the end of the assistant turn is cached, less the one token the
    model sampled last (the turn end: its KV was never computed)."""
    turn_end = CHAT_TEMPLATES[tools_server.template].turn_end
    first = tools_server.chat(
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        logit_bias={str(tools_server.token_id(turn_end)): 100.0},  # ends turns as trained
    )
    calls = first.choices[0].message.tool_calls
    _check_calls(calls)
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [call.model_dump(exclude_none=True) for call in calls],
    }
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    conversation = [*MESSAGES, assistant, *results]
    # The same tool_choice: under the generic format, auto's prompt describes the reply
    # envelope instead of the call syntax, so its system turn differs from the first one's.
    second = tools_server.chat(messages=conversation, tool_choice="required", max_tokens=1)
    cached = second.usage.prompt_tokens_details.cached_tokens
    generated = first.usage.prompt_tokens + first.usage.completion_tokens
    turn = tools_server.render([*MESSAGES, assistant])
    end = turn.rindex(turn_end) + len(turn_end)  # the assistant turn, through its end token
    retokenized = len(tools_server.tokenizer(turn[:end], add_special_tokens=False).input_ids)
    print(
        f"{tools_server.template}: generated {generated} tokens (the turn retokenized: "
        f"{retokenized}), cached {cached} of {second.usage.prompt_tokens}"
    )
    assert cached == generated - 1


@pytest.mark.parametrize("parallel", [True, False])
def test_responses_api_calls_in_each_format(tools_server: ToolServer, parallel: bool):
    """The Responses API on each template: function_call items in the server's format,
    streamed (name first, then argument fragments) as they are returned whole."""
    request = {
        "model": tools_server.model,
        "instructions": MESSAGES[0]["content"],
        "input": MESSAGES[1]["content"],
        "tools": [responses_tool(tool) for tool in TOOLS],
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "max_output_tokens": 120,
        "temperature": 0,
    }
    whole = tools_server.client.responses.create(**request)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and (parallel or len(calls) == 1)
    assert [item.type for item in whole.output] == ["function_call"] * len(calls)
    for call in calls:  # a call max_output_tokens cut off stays, marked incomplete
        if call.status == "completed":
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        else:
            assert call.status == "incomplete" and whole.status == "incomplete"
    assert calls[0].status == "completed"
    events = list(tools_server.client.responses.create(stream=True, **request))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(item.name, item.arguments) for item in added] == [(c.name, "") for c in calls]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [call.arguments for call in calls]
    streamed = events[-1].response
    assert [c.arguments for c in streamed.output] == [c.arguments for c in calls]


def test_generic_responses_continuation_renders_as_the_whole_conversation(
    tools_server: ToolServer,
):
    """Generic format: a turn continued from the previous response's KV gets the prompt the
    whole conversation re-sent as items gets — the tool result names its tool in both."""
    if tools_server.template != "plain":
        pytest.skip("the generic format's rendering only")
    common = {
        "model": tools_server.model,
        "instructions": MESSAGES[0]["content"],
        "tools": [responses_tool(tool) for tool in TOOLS],
        "temperature": 0,
        # Every turn the same choice: under auto the system turn describes the reply envelope.
        "tool_choice": {"type": "function", "name": "get_time"},
    }
    first = tools_server.client.responses.create(
        input=MESSAGES[1]["content"],
        parallel_tool_calls=False,
        max_output_tokens=120,
        **common,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    second = tools_server.client.responses.create(
        previous_response_id=first.id, input=[result], max_output_tokens=1, **common
    )
    item = {"type": "function_call", "call_id": call.call_id, "name": call.name}
    resent = tools_server.client.responses.create(
        input=[
            {"role": "user", "content": MESSAGES[1]["content"]},
            item | {"arguments": call.arguments},
            result,
        ],
        max_output_tokens=1,
        **common,
    )
    assert first.usage and second.usage and resent.usage
    assert second.usage.input_tokens == resent.usage.input_tokens
    reused = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= reused


def test_generic_auto_replies_in_the_envelope(tools_server: ToolServer):
    """Generic format under auto: the reply is the envelope, a call or an answer as the model
    chooses (here steered by a bias towards one key); a call streams as call deltas and an
    answer as content, both rebuilding the whole response."""
    if tools_server.template != "plain":
        pytest.skip("the generic format's envelope only")

    def towards(key: str) -> dict[str, float]:
        ids = tools_server.tokenizer(f'"{key}"', add_special_tokens=False).input_ids
        return {str(i): 30.0 for i in ids}

    options = {"max_tokens": 160, "parallel_tool_calls": False, "logit_bias": towards("tool_call")}
    choice = tools_server.chat(**options).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    _check_calls(calls)
    assert len(calls) == 1
    content, streamed, reason = _stream(tools_server, **options)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["args"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    options = {"max_tokens": 24, "logit_bias": towards("response")}
    choice = tools_server.chat(**options).choices[0]
    assert not choice.message.tool_calls and choice.message.content
    assert not choice.message.content.lstrip().startswith("{")  # the answer, unwrapped
    content, streamed, reason = _stream(tools_server, **options)
    assert content == choice.message.content and not streamed
    assert reason == choice.finish_reason


def test_generic_auto_envelope_in_the_responses_api(tools_server: ToolServer):
    if tools_server.template != "plain":
        pytest.skip("the generic format's envelope only")
    ids = tools_server.tokenizer('"tool_call"', add_special_tokens=False).input_ids
    response = tools_server.client.responses.create(
        model=tools_server.model,
        input=MESSAGES[1]["content"],
        tools=[responses_tool(tool) for tool in TOOLS],
        parallel_tool_calls=False,
        max_output_tokens=160,
        temperature=0,
        extra_body={"logit_bias": {str(i): 30.0 for i in ids}},
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert [item.type for item in response.output] == ["function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_generic_auto_envelope_in_the_messages_api(tools_server: ToolServer):
    """The Messages API under auto on a template without tool syntax: the prompt describes the
    envelope (it differs from a forced turn's), and a call or an answer comes back as blocks,
    never as the envelope's JSON, the stream equal to the plain message."""
    if tools_server.template != "plain":
        pytest.skip("the generic format's envelope only")
    url = str(tools_server.client.base_url).removesuffix("/v1/")
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    question = [MESSAGES[1]]
    with anthropic.Anthropic(base_url=url, api_key="unused", timeout=120.0, max_retries=0) as c:
        counted = {
            kind: c.messages.count_tokens(
                model=tools_server.model, messages=question, tools=tools, tool_choice={"type": kind}
            ).input_tokens
            for kind in ("auto", "any")
        }
        assert counted["auto"] != counted["any"]
        for key, max_tokens in (("tool_call", 160), ("response", 24)):
            ids = tools_server.tokenizer(f'"{key}"', add_special_tokens=False).input_ids
            request: dict[str, Any] = {
                "model": tools_server.model,
                "max_tokens": max_tokens,
                "messages": question,
                "tools": tools,
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                "extra_body": {"temperature": 0.0, "logit_bias": {str(i): 30.0 for i in ids}},
            }
            message = c.messages.create(**request)
            with c.messages.stream(**request) as stream:
                streamed = stream.get_final_message()
            blocks = [b.model_dump(exclude_none=True) for b in message.content]
            assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == [
                {k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}
                for b in streamed.content
            ]
            if key == "tool_call":
                assert message.stop_reason == "tool_use"
                [call] = message.content
                assert call.type == "tool_use"
                jsonschema.validate(call.input, SCHEMAS[call.name])
            else:
                assert [b.type for b in message.content] == ["text"]
                assert not message.content[0].text.lstrip().startswith("{")


def test_generic_auto_free_reply_envelope(tools_server: ToolServer):
    """``reply_envelope: "free"``: the prompt of the envelope, no constraint on the reply (a
    bias towards a word the envelope's grammar refuses writes that word), in chat, the
    Responses API and the Messages API; with a response format it is a 400 naming the field."""
    if tools_server.template != "plain":
        pytest.skip("the generic format's envelope only")
    word = tools_server.tokenizer("Hello", add_special_tokens=False).input_ids[0]
    options: dict[str, Any] = {"max_tokens": 8, "logit_bias": {str(word): 100.0}}
    held = tools_server.chat(**options)
    free = tools_server.chat(**options, extra_body={"reply_envelope": "free"})
    assert held.usage.prompt_tokens == free.usage.prompt_tokens  # the same prompt
    assert not (held.choices[0].message.content or "").startswith("Hello")
    assert free.choices[0].message.content.startswith("HelloHello")
    assert not free.choices[0].message.tool_calls
    response = tools_server.client.responses.create(
        model=tools_server.model,
        input=MESSAGES[1]["content"],
        tools=[responses_tool(tool) for tool in TOOLS],
        max_output_tokens=8,
        temperature=0,
        extra_body={"logit_bias": {str(word): 100.0}, "reply_envelope": "free"},
    )
    assert response.output_text.startswith("HelloHello")
    url = str(tools_server.client.base_url).removesuffix("/v1/")
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    with anthropic.Anthropic(base_url=url, api_key="unused", timeout=120.0, max_retries=0) as c:
        message = c.messages.create(
            model=tools_server.model,
            max_tokens=8,
            messages=[MESSAGES[1]],
            tools=tools,
            extra_body={
                "temperature": 0.0,
                "logit_bias": {str(word): 100.0},
                "reply_envelope": "free",
            },
        )
    assert message.content[0].type == "text" and message.content[0].text.startswith("Hello")
    for extra in (
        {"reply_envelope": "free", "response_format": {"type": "json_object"}},
        {"reply_envelope": "loose"},
    ):
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": tools_server.model, "messages": MESSAGES, "tools": TOOLS, **extra},
            timeout=60.0,
        )
        assert reply.status_code == 400 and "reply_envelope" in reply.text
