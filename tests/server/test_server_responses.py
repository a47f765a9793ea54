"""The Responses API against a live server, through the ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from runtime.server import ServerProcess
from tests.tool_fixtures import responses_tool, time_tool, weather_tool

WEATHER = responses_tool(weather_tool(12, None, "The weather in a city."), strict=True)
TIME = responses_tool(time_tool({"enum": ["UTC", "CET"]}, closed=False))
ITEM_EVENTS = {
    "message": [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ],
    "function_call": [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ],
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def test_text_response(client: openai.OpenAI, model: str):
    response = client.responses.create(
        model=model, input="Say hello.", max_output_tokens=8, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage is not None and 1 <= usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == 8


def test_stream_events_and_equality(client: openai.OpenAI, model: str):
    args = {"model": model, "input": "Tell me a story.", "max_output_tokens": 10, "temperature": 0}
    plain = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    middle = [kind for kind in kinds[2:-1] if kind != "response.output_text.delta"]
    expected = [k for k in ITEM_EVENTS["message"] if k != "response.output_text.delta"]
    assert middle == expected
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == plain.output_text
    assert final.status == plain.status


def test_required_single_tool_call(client: openai.OpenAI, model: str):
    response = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert response.status == "completed"
    calls = _calls(response)
    assert len(calls) == 1 and [item.type for item in response.output] == ["function_call"]
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)


def test_named_tool_choice_streamed(client: openai.OpenAI, model: str):
    events = list(
        client.responses.create(
            model=model,
            input="What time is it?",
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "name": "get_time"},
            parallel_tool_calls=False,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    middle = [e.type for e in events[2:-1] if e.type != "response.function_call_arguments.delta"]
    expected = [k for k in ITEM_EVENTS["function_call"] if "delta" not in k]
    assert middle == expected
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_time" and added.arguments == ""
    fragments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1].response
    assert final.status == "completed"
    assert fragments == done.arguments == _calls(final)[0].arguments
    jsonschema.validate(json.loads(done.arguments), TIME["parameters"])


def test_json_schema_format(client: openai.OpenAI, model: str):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}, "score": {"type": "integer"}},
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="Answer in JSON.",
        text={
            "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
        },
        max_output_tokens=60,
        temperature=0,
        # Compact: the random model's aligned answer does not fit 60 tokens (the layouts are
        # tested in test_json_format.py).
        extra_body={"json_format": "compact"},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format.type == "json_schema"


def test_previous_response_continues_from_cached_kv(client: openai.OpenAI, model: str):
    first = client.responses.create(
        model=model,
        instructions="You help with the weather.",
        input="What is the weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    call = _calls(first)[0]
    second = client.responses.create(
        model=model,
        instructions="You help with the weather.",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    assert second.previous_response_id == first.id
    # Everything up to the end of the first turn is reused, its answer included.
    before = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= before
    # The same conversation re-sent as items gives a prompt of the same length.
    resent = client.responses.create(
        model=model,
        instructions="You help with the weather.",
        input=[
            {"role": "user", "content": "What is the weather in Rome?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0,
    )
    assert resent.status in ("completed", "incomplete") and resent.usage is not None


def test_store_retrieve_delete_and_input_items(client: openai.OpenAI, model: str):
    response = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "first"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    again = client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text
    items = client.responses.input_items.list(response.id, order="asc")
    assert [item.role for item in items.data] == ["user", "user"]
    assert items.data[0].id != items.data[1].id
    # An input item can be referenced by id in a later request.
    ref = client.responses.create(
        model=model,
        input=[{"type": "item_reference", "id": items.data[0].id}],
        max_output_tokens=2,
    )
    assert ref.status in ("completed", "incomplete")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_store_false_is_not_kept(client: openai.OpenAI, model: str):
    response = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    for previous in (response.id, "resp_never_made"):  # no turn goes on without its context
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(
                model=model, input="again", previous_response_id=previous, max_output_tokens=2
            )
        assert info.value.body["param"] == "previous_response_id"
        assert info.value.body["code"] == "previous_response_not_found"
        assert previous in info.value.body["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "image_generation_call"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "n"}},
            "tool_choice",
        ),
        ({"input": "x", "unknown_field": 1}, "unknown_field"),
        ({"input": [{"type": "item_reference", "id": "msg_missing"}]}, "input.0"),
        ({"input": []}, "input"),
    ],
)
def test_bad_requests_name_the_field(server: ServerProcess, model: str, body: dict, param: str):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": model, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_unknown_model_and_response(server: ServerProcess):
    response = httpx.post(
        f"{server.url}/v1/responses", json={"model": "nope", "input": "x"}, timeout=30
    )
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    for method in ("GET", "DELETE"):
        missing = httpx.request(method, f"{server.url}/v1/responses/resp_missing", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_raw_stream_is_named_server_sent_events(server: ServerProcess, model: str):
    body = {"model": model, "input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert len(lines) % 2 == 0
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == name[len("event: ") :]
    assert "[DONE]" not in lines[-1]


@pytest.mark.parametrize("max_tokens", [5, 40])
def test_previous_response_chain_reuses_every_turn(
    client: openai.OpenAI, model: str, max_tokens: int
):
    """Text turns cut by max_output_tokens (no stop token) or ended by the model: each turn's
    prompt starts with all the tokens of the turn before."""
    previous = None
    for turn in range(3):
        response = client.responses.create(
            model=model,
            instructions="Chat.",
            input=f"Turn {turn}: say something.",
            previous_response_id=previous.id if previous else None,
            max_output_tokens=max_tokens,
            temperature=0,
        )
        assert response.usage is not None
        if previous is not None:
            assert previous.usage is not None
            reusable = previous.usage.input_tokens + previous.usage.output_tokens - 1
            assert response.usage.input_tokens_details.cached_tokens >= reusable
            assert response.usage.input_tokens > reusable
        previous = response


VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}},
    "required": ["verdict"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("steer", ["{", "<tool_call>"])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_auto_with_a_format_is_calls_or_the_answer(
    client: openai.OpenAI, model: str, tokenizer: Any, steer: str, api: str
):
    """tool_choice auto with a JSON schema format: the output is tool calls or an answer valid
    against the schema, nothing else; a bias on the first token picks which."""
    bias = {str(tokenizer.convert_tokens_to_ids(steer)): 30}
    if api == "responses":
        response = client.responses.create(
            model=model,
            input="Weather or verdict?",
            tools=[WEATHER],
            text={"format": {"type": "json_schema", "name": "v", "schema": VERDICT}},
            max_output_tokens=60,
            temperature=0,
            extra_body={"logit_bias": bias},
        )
        calls = _calls(response)
        text = response.output_text
    else:
        tool = weather_tool(12, None)  # WEATHER for the chat API
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather or verdict?"}],
            tools=[tool],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "v", "schema": VERDICT},
            },
            max_tokens=60,
            temperature=0,
            logit_bias=bias,
        )
        message = reply.choices[0].message
        calls = [call.function for call in message.tool_calls or []]
        text = message.content or ""
    if steer == "{":
        assert not calls
        jsonschema.validate(json.loads(text), VERDICT)
    else:
        assert calls and not text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_schema_the_runtime_refuses_names_its_field(server: ServerProcess, model: str):
    """A constraint that fails to compile in the scheduler is a 400 naming the request field,
    in each API's spelling."""
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    responses = httpx.post(
        f"{server.url}/v1/responses",
        json={
            "model": model,
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "b", "schema": bad}},
        },
        timeout=30,
    )
    native = httpx.post(
        f"{server.url}/generate",
        json={"text": "x", "sampling_params": {"json_schema": bad, "max_new_tokens": 2}},
        timeout=30,
    )
    assert responses.status_code == native.status_code == 400
    assert responses.json()["error"]["param"] == "text.format"
    assert native.json()["error"]["param"] == "sampling_params.json_schema"
