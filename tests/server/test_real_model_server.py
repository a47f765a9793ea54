"""`arbor serve` with no model path serves the built-in real model (SmolLM2-135M-Instruct,
Q4_1 GGUF), and real clients get real answers: the openai client's chat (plain and streamed),
a JSON-schema extraction, and a DSL program over HTTP."""

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

import frontend_lang as fl
from frontend_lang.demo import travel_program
from runtime.model_files import builtin_model_path, locate_model
from runtime.server import ServerProcess
from runtime.server.demo import PERSON_SCHEMA, extract_person

QUESTION = [{"role": "user", "content": "Tell me the capital of France."}]


@pytest.fixture(scope="module")
def real_server() -> Iterator[ServerProcess]:
    with ServerProcess(None, "--max-total-tokens", "8192") as server:
        yield server


@pytest.fixture(scope="module")
def real_client(real_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="-", timeout=120.0) as client:
        yield client


def test_serves_the_builtin_model_under_its_gguf_name(
    real_server: ServerProcess, real_client: openai.OpenAI
) -> None:
    path = builtin_model_path()
    [model] = real_client.models.list().data
    assert model.id == locate_model(path).served_name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    info = httpx.get(f"{real_server.url}/get_model_info", timeout=10.0).json()
    assert info["model_path"] == path


def test_chat_answers_a_known_question_and_stops_at_eos(
    real_client: openai.OpenAI,
) -> None:
    model = real_client.models.list().data[0].id
    reply = real_client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop" and "<|im_end|>" not in (choice.message.content or "")
    path = Path(builtin_model_path())
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = reference.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    chunks = real_client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=48,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content


def test_json_schema_extraction(real_client: openai.OpenAI) -> None:
    reply = extract_person(real_client, real_client.models.list().data[0].id)
    person: dict[str, Any] = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(person, PERSON_SCHEMA)
    assert person["name"] == "Maria Lopez" and person["city"] == "Madrid"


def test_dsl_program_over_http(real_server: ServerProcess) -> None:
    backend = fl.RuntimeEndpoint(real_server.url)
    try:
        state = travel_program().run(city="Rome", backend=backend)
    finally:
        backend.shutdown()
    assert state["continent"] == "Europe"
    assert len(state["fact"]) == 2 and all(fact.strip() for fact in state["fact"])
    assert not any("<|im_end|>" in fact for fact in state["fact"])


def test_required_tool_call_in_the_generic_format(
    real_server: ServerProcess, real_client: openai.OpenAI
) -> None:
    """SmolLM2's template has no tool syntax: the server describes the tools itself (the
    generic format), and a required call names the right one of two tools."""
    assert real_server.server_info()["tool_call_format"] == "generic"
    tools: list[Any] = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
        for name, description in [
            ("get_time", "Get the current local time in a city."),
            ("get_weather", "Get the current weather in a city."),
        ]
    ]
    reply = real_client.chat.completions.create(
        model=real_client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_calls_for_a_tool_question_and_answers_the_rest(
    real_server: ServerProcess, real_client: openai.OpenAI
) -> None:
    """Under auto the server scores the tool's name and holds the generic envelope to a call
    or an answer (runtime/server/tool_decision.py): SmolLM2 left to pick the envelope's key
    calls on nearly every request; scored, a weather question calls and the others answer."""
    tool: Any = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    model = real_client.models.list().data[0].id

    def reply(question: str) -> Any:
        return real_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            tools=[tool],
            tool_choice="auto",
            parallel_tool_calls=False,
            max_tokens=48,
            temperature=0,
        ).choices[0]

    weather = reply("What is the weather like in Oslo right now?")
    assert weather.finish_reason == "tool_calls" and weather.message.tool_calls
    assert json.loads(weather.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    for question in ("Write a short poem about the moon.", "What is 15 plus 27?"):
        answer = reply(question)
        assert not answer.message.tool_calls and answer.message.content, question
