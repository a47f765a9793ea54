"""Reasoning models through the real server and the ``openai`` client: ``reasoning_content``
apart from ``content`` (streamed and not), constraints that start after ``</think>``, and
``chat_template_kwargs``.

The test model (qwen3 template) thinks noise; logit_bias on ``<think>`` / ``</think>``, found
by a sweep through ``/generate``, makes a greedy output open and close its reasoning. The
unconstrained output under the same bias is the reference for the thinking: a constraint must
not have touched it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from runtime.chat.plan import after_reasoning
from runtime.chat.turn_spec import ToolChoice, TurnSpec
from runtime.errors import RequestError
from runtime.sampling_params import SamplingParams
from runtime.server import ServerProcess
from tests.server.server_process import POOL, sse_payloads
from tests.tool_fixtures import weather_tool

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
TOOL = weather_tool(None)


def _server(model: Path, parser: str) -> Iterator[ServerProcess]:
    process = ServerProcess(model, *POOL, "--reasoning-parser", parser)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def qwen3_server(thinking_model_path: Path) -> Iterator[ServerProcess]:
    yield from _server(thinking_model_path, "qwen3")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0)


@pytest.fixture(scope="module")
def tokenizer(thinking_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(thinking_model_path)


@pytest.fixture(scope="module")
def tags(tokenizer: Any) -> tuple[str, str]:
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return str(start), str(end)


def _sweep(
    server: ServerProcess, prompt: str, end: str, bases: list[dict[str, Any]], min_thinking: int
) -> tuple[dict[str, Any], str]:
    """Sampling options (one of ``bases`` plus a logit_bias on ``end``) under which the greedy
    output of ``prompt`` closes its reasoning after at least ``min_thinking`` tokens, and that
    output's text through ``</think>``."""
    tries = [
        {**base, "logit_bias": {**base.get("logit_bias", {}), end: b / 4}}
        for base in bases
        for b in range(0, 60)
    ]
    params = [{"temperature": 0, "max_new_tokens": 16, **t} for t in tries]
    body = {"text": [prompt] * len(params), "sampling_params": params}
    outs = httpx.post(f"{server.url}/generate", json=body, timeout=120.0).json()
    for options, out in zip(tries, outs, strict=True):
        ids = out["output_ids"]
        if int(end) in ids and ids.index(int(end)) >= min_thinking:
            return options, out["text"].split("</think>")[0] + "</think>"
    raise AssertionError("no bias closes this model's reasoning")


def _chat(client: openai.OpenAI, options: dict[str, Any], **request: Any) -> Any:
    """A greedy chat request; ``options`` are sampling extensions (logit_bias, penalties)."""
    extra = {k: v for k, v in options.items() if k != "logit_bias"}
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=request.pop("messages", MESSAGES),
        temperature=0,
        max_tokens=request.pop("max_tokens", 40),
        logit_bias=options.get("logit_bias"),
        extra_body={**extra, **request.pop("extra_body", {})},
        **request,
    )


def _streamed(client: openai.OpenAI, options: dict[str, Any], **request: Any) -> tuple[str, str]:
    """(reasoning, content) of a streamed chat, checking that all reasoning comes first."""
    reasoning, content = [], []
    for chunk in _chat(client, options, stream=True, **request):
        delta = chunk.choices[0].delta
        thought = (delta.model_extra or {}).get("reasoning_content")
        if thought:
            assert not content, "reasoning after content"
            reasoning.append(thought)
        if delta.content:
            content.append(delta.content)
    return "".join(reasoning), "".join(content)


def test_deepseek_r1_splits_reasoning_and_constrains_the_answer(
    r1_server: ServerProcess, tokenizer: Any, tags: tuple[str, str]
):
    """deepseek-r1: the output starts inside the reasoning; the schema applies after it."""
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    options, thinking = _sweep(r1_server, prompt, tags[1], [{}], min_thinking=3)
    with _client(r1_server) as client:
        message = _chat(client, options, response_format=RESPONSE_FORMAT).choices[0].message
        assert message.model_extra["reasoning_content"] == thinking.removesuffix("</think>")
        jsonschema.validate(json.loads(message.content), SCHEMA)
        streamed = _streamed(client, options, response_format=RESPONSE_FORMAT)
        assert streamed == (message.model_extra["reasoning_content"], message.content)
        free = _chat(client, options).choices[0].message  # no constraint: the same thinking
        assert free.model_extra["reasoning_content"] == message.model_extra["reasoning_content"]


def test_tool_calls_are_parsed_from_the_answer_alone(
    r1_server: ServerProcess, tokenizer: Any, tags: tuple[str, str]
):
    prompt = tokenizer.apply_chat_template(
        MESSAGES, tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    options, thinking = _sweep(r1_server, prompt, tags[1], [{}], min_thinking=3)
    with _client(r1_server) as client:
        choice = _chat(
            client,
            options,
            tools=[TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
        ).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.model_extra["reasoning_content"] == thinking[: -len("</think>")]
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, TOOL["function"]["parameters"])
        assert not choice.message.content


def test_qwen3_output_that_opens_its_reasoning(
    qwen3_server: ServerProcess, tokenizer: Any, tags: tuple[str, str]
):
    """qwen3: the model writes <think> itself (biased; penalties stop it repeating <think>)."""
    start, end = tags
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    penalties = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
    bases = [{**penalties, "logit_bias": {start: b}} for b in (7.0, 8.0, 9.0)]
    options, thinking = _sweep(qwen3_server, prompt, end, bases, min_thinking=3)
    assert thinking.startswith("<think>")
    with _client(qwen3_server) as client:
        message = _chat(client, options, response_format=RESPONSE_FORMAT).choices[0].message
        expected = thinking.removeprefix("<think>").removesuffix("</think>")
        assert message.model_extra["reasoning_content"] == expected
        jsonschema.validate(json.loads(message.content), SCHEMA)
        streamed = _streamed(client, options, response_format=RESPONSE_FORMAT)
        assert streamed == (expected, message.content)


def test_qwen3_output_without_reasoning_is_all_content(qwen3_server: ServerProcess, tags):
    start, _ = tags
    no_think = {"logit_bias": {start: -100.0}}
    with _client(qwen3_server) as client:
        free = _chat(client, no_think, max_tokens=12).choices[0].message
        assert free.model_extra["reasoning_content"] is None and free.content
        assert _streamed(client, no_think, max_tokens=12) == ("", free.content)
        # A constraint then applies from the first token.
        message = _chat(client, no_think, response_format=RESPONSE_FORMAT).choices[0].message
        assert message.model_extra["reasoning_content"] is None
        jsonschema.validate(json.loads(message.content), SCHEMA)


def test_enable_thinking_false_through_chat_template_kwargs(qwen3_server: ServerProcess):
    """The template closes an empty think block in the prompt: the answer is constrained from
    its first token, with no bias at all."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    with _client(qwen3_server) as client:
        response = _chat(client, {}, response_format=RESPONSE_FORMAT, extra_body=kwargs)
        message = response.choices[0].message
        assert message.model_extra["reasoning_content"] is None
        jsonschema.validate(json.loads(message.content), SCHEMA)
        thinking = _chat(client, {}, response_format=RESPONSE_FORMAT, max_tokens=4)
        # With thinking on, the prompt is shorter by the empty block "<think>\n\n</think>\n\n".
        assert response.usage.prompt_tokens == thinking.usage.prompt_tokens + 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ("enable_thinking", "chat_template_kwargs"),
        ({f"k{i}": 1 for i in range(65)}, "chat_template_kwargs"),
        ({"x": "y" * 70_000}, "chat_template_kwargs"),
        ({"tokenize": True}, "'tokenize' is not a template variable"),
        ({"namespace": 1}, "not callable"),  # a template error: it calls namespace()
    ],
)
def test_bad_chat_template_kwargs_are_400(qwen3_server: ServerProcess, kwargs, message: str):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs}
    with _client(qwen3_server) as client:
        body["model"] = client.models.list().data[0].id
    response = httpx.post(f"{qwen3_server.url}/v1/chat/completions", json=body, timeout=30.0)
    assert response.status_code == 400, response.text
    assert message in response.text


def test_a_constraint_needs_the_tags_as_single_tokens(tiny_model_path: Path):
    """The default test tokenizer has no <think> tokens: no constraint can wait for one."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    spec = TurnSpec([], [], ToolChoice("none"), {}, param_names={"answer": "response_format"})
    constrained = SamplingParams(json_schema=SCHEMA)
    for name in ("qwen3", "deepseek-r1"):
        with pytest.raises(RequestError, match="</think> to be single tokens") as info:
            after_reasoning(spec, name, tokenizer, constrained)
        assert info.value.status_code == 400 and info.value.param == "response_format"
        free = SamplingParams()
        assert after_reasoning(spec, name, tokenizer, free) is free


def test_responses_api_reasoning_item_then_constrained_answer(
    r1_server: ServerProcess, tokenizer: Any, tags: tuple[str, str]
):
    """The Responses API: a reasoning item (streamed as reasoning_text events), then the
    answer, which alone the schema constrains; reasoning tokens counted in the usage."""
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    options, thinking = _sweep(r1_server, prompt, tags[1], [{}], min_thinking=3)
    request = {
        "model": "unused",
        "input": MESSAGES[0]["content"],
        "text": {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA}},
        "max_output_tokens": 40,
        "temperature": 0,
    }
    with _client(r1_server) as client:
        request["model"] = client.models.list().data[0].id
        response = client.responses.create(**request, extra_body=options)
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message"]
        assert response.output[0].content[0].text == thinking.removesuffix("</think>")
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
        free = client.responses.create(
            **{k: v for k, v in request.items() if k != "text"}, extra_body=options
        )  # no constraint: the same thinking
        assert free.output[0].type == "reasoning"
        assert free.output[0].content[0].text == response.output[0].content[0].text
        thinking_tokens = len(tokenizer(thinking, add_special_tokens=False).input_ids)
        assert response.usage.output_tokens_details.reasoning_tokens == thinking_tokens
        events = list(client.responses.create(**request, extra_body=options, stream=True))
    names = [e.type for e in events]
    last_reasoning = max(i for i, n in enumerate(names) if n == "response.reasoning_text.delta")
    first_text = names.index("response.output_text.delta")
    assert last_reasoning < first_text
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == response.output[0].content[0].text
    assert events[-1].response.output_text == response.output_text


@pytest.mark.parametrize(
    "options",
    [
        {"reasoning": {"effort": "none"}},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ],
)
def test_responses_api_without_thinking(qwen3_server: ServerProcess, options: dict[str, Any]):
    """reasoning.effort "none" (or the template variable itself) closes the think block in the
    prompt: no reasoning item, the schema applies from the first token."""
    with _client(qwen3_server) as client:
        model = client.models.list().data[0].id
        request = {
            "model": model,
            "input": MESSAGES[0]["content"],
            "text": {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA}},
            "max_output_tokens": 40,
            "temperature": 0,
        }
        response = client.responses.create(**request, **options)
        thinking = client.responses.create(**{**request, "max_output_tokens": 4})
    assert [item.type for item in response.output] == ["message"]
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.usage.input_tokens == thinking.usage.input_tokens + 4


def test_chat_reasoning_effort_none_turns_thinking_off(qwen3_server: ServerProcess):
    """reasoning_effort "none" in chat, as in Responses: the prompt closes the think block (no
    reasoning, the schema from the first token); another effort leaves the thinking on."""
    with _client(qwen3_server) as client:
        model = client.models.list().data[0].id
        request = {
            "model": model,
            "messages": MESSAGES,
            "response_format": RESPONSE_FORMAT,
            "max_tokens": 40,
            "temperature": 0,
        }
        off = client.chat.completions.create(**request, reasoning_effort="none")
        on = client.chat.completions.create(**request | {"max_tokens": 4}, reasoning_effort="low")
    jsonschema.validate(json.loads(off.choices[0].message.content or ""), SCHEMA)
    assert (off.choices[0].message.model_extra or {}).get("reasoning_content") is None
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty think block


def _stream_calls(client: openai.OpenAI, options: dict[str, Any], **request: Any) -> Any:
    """(reasoning, content, [(name, arguments)], finish reason) of a streamed chat."""
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in _chat(client, options, stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            assert not piece.function.name or piece.index not in calls
            call = calls.setdefault(piece.index, [piece.function.name or "", ""])
            call[1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", ["deepseek-r1", "qwen3"])
def test_forced_tool_calls_land_after_the_reasoning(
    request: pytest.FixtureRequest, parser: str, tokenizer: Any, tags: tuple[str, str]
):
    """tool_choice required / named with a reasoning parser: the thinking is free, the calls
    follow </think> and are returned as tool_calls (chat and Responses, streamed and not),
    never inside the reasoning."""
    server = request.getfixturevalue("r1_server" if parser == "deepseek-r1" else "qwen3_server")
    start, end = tags
    prompt = tokenizer.apply_chat_template(
        MESSAGES, tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    bases: list[dict[str, Any]] = [{}]
    if parser == "qwen3":  # the model opens the block itself (biased, as above)
        penalties = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
        bases = [{**penalties, "logit_bias": {start: b}} for b in (7.0, 8.0, 9.0)]
    options, thinking = _sweep(server, prompt, end, bases, min_thinking=3)
    expected = thinking.removeprefix("<think>").removesuffix("</think>")
    named = {"type": "function", "function": {"name": "get_weather"}}
    with _client(server) as client:
        for choice in ("required", named):
            request_options = {
                "tools": [TOOL],
                "tool_choice": choice,
                "parallel_tool_calls": False,
                "max_tokens": 120,
            }
            whole = _chat(client, options, **request_options).choices[0]
            message = whole.message
            assert whole.finish_reason == "tool_calls", (options, message)
            assert message.model_extra["reasoning_content"] == expected
            assert "get_weather" not in expected and not message.content
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
            assert [name for name, _ in calls] == ["get_weather"]
            jsonschema.validate(json.loads(calls[0][1]), TOOL["function"]["parameters"])
            streamed = _stream_calls(client, options, **request_options)
            assert streamed == (expected, "", calls, "tool_calls")
        body = {
            "model": client.models.list().data[0].id,
            "input": MESSAGES[0]["content"],
            "tools": [{"type": "function", **TOOL["function"]}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 120,
            "temperature": 0,
        }
        response = client.responses.create(**body, extra_body=options)
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[0].content[0].text == expected
        assert (response.output[1].name, response.output[1].arguments) == calls[0]
        events = list(client.responses.create(**body, extra_body=options, stream=True))
        assert events[-1].response.output[1].arguments == calls[0][1]
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == expected


def test_native_require_reasoning(r1_server: ServerProcess, tokenizer: Any, tags):
    """/generate with require_reasoning: the schema applies after </think> and the result
    splits the thinking from the answer, whole and streamed; without it the schema applies
    from the first token and the text is raw."""
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    options, thinking = _sweep(r1_server, prompt, tags[1], [{}], min_thinking=3)
    params = {"temperature": 0, "max_new_tokens": 40, "json_schema": SCHEMA, **options}
    body = {"text": prompt, "sampling_params": params, "require_reasoning": True}
    url = f"{r1_server.url}/generate"
    out = httpx.post(url, json=body, timeout=60.0).json()
    assert out["reasoning_content"] == thinking.removesuffix("</think>")
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60.0) as response:
        events = list(sse_payloads(response.iter_lines()))
    assert "".join(e["reasoning_delta"] for e in events) == out["reasoning_content"]
    assert "".join(e["delta"] for e in events) == out["text"] == events[-1]["text"]
    raw = httpx.post(url, json=body | {"require_reasoning": False}, timeout=60.0).json()
    assert "reasoning_content" not in raw
    jsonschema.validate(json.loads(raw["text"]), SCHEMA)
