"""A reply that continues the final assistant message (Anthropic's prefill, vLLM's
``continue_final_message`` on chat completions), under a constraint that covers the prefill and
the reply together; and the SDKs' own dumps of response blocks and messages sent back as input.

The tiny random-weight model (keyed server, chatml-style template) writes arbitrary text, so
each continuation is checked against the raw completion of the prompt it must have: the
conversation's generation prompt, then the prefill's tokens. Schemas are small and bounded, as
in the other JSON tests, so a constrained reply ends within ``max_tokens``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from anthropic.types import TextBlock, ToolUseBlock
from transformers import AutoTokenizer

from runtime.server import ServerProcess
from tests.server.server_process import API_KEY as KEY

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0}
NAME_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}},
    "required": ["name"],
    "additionalProperties": False,
}
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    return keyed_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def _completion(client: openai.OpenAI, model: str, ids: list[int], max_tokens: int) -> str:
    return (
        client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0)
        .choices[0]
        .text
    )


def _prefilled_ids(tokenizer: Any, prefill: str) -> list[int]:
    """The prompt a continued reply to QUESTION has: the generation prompt (the template's
    opening of an assistant turn), then the prefill."""
    head = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    encode = tokenizer
    return list(encode(head, add_special_tokens=False).input_ids) + list(
        encode(prefill, add_special_tokens=False).input_ids
    )


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"x-api-key": KEY}, timeout=60.0)


def test_a_prefill_is_continued(
    claude: anthropic.Anthropic, client: openai.OpenAI, model: str, tokenizer: Any
) -> None:
    prefill = "The weather in"
    messages = [*QUESTION, {"role": "assistant", "content": prefill}]
    message = claude.messages.create(
        model=model, max_tokens=8, messages=messages, extra_body=GREEDY
    )
    ids = _prefilled_ids(tokenizer, prefill)
    assert message.content[0].type == "text"
    assert message.content[0].text == _completion(client, model, ids, 8)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(ids)
    counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
    assert counted == len(ids)


def test_a_prefill_under_a_schema_is_part_of_the_json(
    claude: anthropic.Anthropic, model: str
) -> None:
    prefill = '{"name": "'
    message = claude.messages.create(
        model=model,
        max_tokens=40,
        messages=[*QUESTION, {"role": "assistant", "content": [{"type": "text", "text": prefill}]}],
        extra_body={
            **GREEDY,
            "output_config": {"format": {"type": "json_schema", "schema": NAME_SCHEMA}},
        },
    )
    assert message.stop_reason == "end_turn"
    text = message.content[0].text
    assert not text.startswith(prefill)  # the reply holds the continuation alone
    jsonschema.validate(json.loads(prefill + text), NAME_SCHEMA)


@pytest.mark.parametrize(
    ("prefill", "named"),
    [
        pytest.param('{"age"', "messages", id="a-key-the-schema-forbids"),
        pytest.param("Sure", "messages", id="text-before-the-json"),
    ],
)
def test_a_prefill_the_schema_cannot_continue_is_a_400(
    server: ServerProcess, model: str, prefill: str, named: str
) -> None:
    body = {
        "model": model,
        "max_tokens": 8,
        "messages": [*QUESTION, {"role": "assistant", "content": prefill}],
        "output_config": {"format": {"type": "json_schema", "schema": NAME_SCHEMA}},
    }
    response = _post(server, "/v1/messages", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(named) and "prefilled answer" in error["message"]


def test_prefill_refusals(server: ServerProcess, model: str) -> None:
    def refused(messages: list[dict[str, Any]], **extra: Any) -> str:
        response = _post(
            server, "/v1/messages", {"model": model, "max_tokens": 4, "messages": messages, **extra}
        )
        assert response.status_code == 400, response.text
        return str(response.json()["error"]["message"])

    spaced = [*QUESTION, {"role": "assistant", "content": [{"type": "text", "text": "Hi "}]}]
    message = refused(spaced)
    assert message == "messages.1: final assistant content cannot end with trailing whitespace"
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    assert "messages.1" in refused([*QUESTION, {"role": "assistant", "content": [call]}])
    forced = refused(
        [*QUESTION, {"role": "assistant", "content": "I"}],
        tools=[TOOL],
        tool_choice={"type": "any"},
    )
    assert forced.startswith("messages.1") and "tool_choice" in forced


def test_continue_final_message_on_chat_completions(
    client: openai.OpenAI, model: str, tokenizer: Any
) -> None:
    prefill = "The weather in"
    messages: Any = [*QUESTION, {"role": "assistant", "content": prefill}]
    continued = {"continue_final_message": True, "add_generation_prompt": False, **GREEDY}
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, extra_body=continued
    )
    ids = _prefilled_ids(tokenizer, prefill)
    assert reply.choices[0].message.content == _completion(client, model, ids, 8)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": NAME_SCHEMA}}
    messages[-1] = {"role": "assistant", "content": '{"name": "'}
    constrained = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, response_format=schema, extra_body=continued
    )
    text = constrained.choices[0].message.content or ""
    assert constrained.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads('{"name": "' + text), NAME_SCHEMA)
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            extra_body={"continue_final_message": True},
        )
    assert "add_generation_prompt" in str(both.value)
    with pytest.raises(openai.BadRequestError) as not_assistant:
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=4,
            extra_body=continued,  # type: ignore[arg-type]
        )
    assert "messages.0" in str(not_assistant.value)
    with pytest.raises(openai.BadRequestError) as refused:
        messages[-1] = {"role": "assistant", "content": "Sure"}
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            response_format=schema,
            extra_body=continued,
        )
    assert refused.value.body["param"] == "messages"  # type: ignore[index]


def test_anthropic_sdk_dumps_round_trip(claude: anthropic.Anthropic, model: str) -> None:
    call = ToolUseBlock(
        type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris"},
        caller={"type": "direct"},
    )  # fmt: skip
    text = TextBlock(type="text", text="Let me look.", citations=None)
    history = [
        *QUESTION,
        {"role": "assistant", "content": [text.model_dump(), call.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}],
        },
    ]
    reply = claude.messages.create(
        model=model,
        max_tokens=4,
        messages=history,
        tools=[TOOL],
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The server's own blocks, as the client parsed them, sent back whole.
    first = claude.messages.create(
        model=model,
        max_tokens=40,
        messages=QUESTION,  # type: ignore[arg-type]
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    dumped = [block.model_dump() for block in first.content]
    assert any(block["type"] == "tool_use" and "caller" in block for block in dumped)
    results = [
        {"type": "tool_result", "tool_use_id": block["id"], "content": "18 C"}
        for block in dumped
        if block["type"] == "tool_use"
    ]
    again = [
        *QUESTION,
        {"role": "assistant", "content": dumped},
        {"role": "user", "content": results},
    ]
    claude.messages.create(
        model=model, max_tokens=4, messages=again, tools=[TOOL], extra_body=GREEDY
    )  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as unknown:
        bad = {**call.model_dump(), "frobnicate": 1}
        claude.messages.create(
            model=model, max_tokens=4,
            messages=[*QUESTION, {"role": "assistant", "content": [bad]}, *history[2:]],  # type: ignore[list-item]
        )  # fmt: skip
    assert "frobnicate" in str(unknown.value)


def test_openai_sdk_dumps_round_trip(client: openai.OpenAI, model: str) -> None:
    tool = {
        "type": "function",
        "function": {"name": TOOL["name"], "parameters": TOOL["input_schema"]},
    }
    first = client.chat.completions.create(
        model=model,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=40,
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0.0,
    )
    message = first.choices[0].message
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"}
        for call in message.tool_calls or []
    ]
    second = client.chat.completions.create(
        model=model,
        messages=[*QUESTION, dumped, *results],
        max_tokens=4,
        tools=[tool],  # type: ignore[list-item]
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    function = {"type": "function", **tool["function"]}  # type: ignore[dict-item]
    response = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        max_output_tokens=40,
        tools=[function],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0.0,
        store=False,
    )
    items = [item.model_dump() for item in response.output]
    assert any(item["type"] == "function_call" and "status" in item for item in items)
    outputs = [
        {"type": "function_call_output", "call_id": item["call_id"], "output": "18 C"}
        for item in items
        if item["type"] == "function_call"
    ]
    text = client.responses.create(model=model, input="Hello", max_output_tokens=4, store=False)
    said = [item.model_dump() for item in text.output]
    assert said and said[0]["type"] == "message" and "annotations" in said[0]["content"][0]
    turn = [{"role": "user", "content": "Hello"}, *said, *items, *outputs]
    again = client.responses.create(model=model, input=turn, max_output_tokens=4, store=False)  # type: ignore[arg-type]
    assert again.status in ("completed", "incomplete")
