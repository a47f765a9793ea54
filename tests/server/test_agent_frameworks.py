"""Real agent frameworks as clients: the OpenAI Agents SDK (Responses API and chat
completions) and langchain-openai, against a live server on the tiny test model.

The model's weights are random, so these tests assert contracts (tools called with
schema-valid arguments, outputs parsing into the declared types, cache hits), never content;
greedy decoding, bounded strings and numbers, and token caps make every output finish.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import jsonschema
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from runtime.server import ServerProcess

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

set_tracing_disabled(True)  # the SDK would export traces to api.openai.com


class Forecast(BaseModel):
    summary: str = Field(max_length=12)
    celsius: int = Field(ge=-50, le=50)


City = Annotated[str, Field(max_length=10)]


@pytest.fixture(scope="module")
def model_name(server: ServerProcess) -> str:
    import httpx

    return httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture()
def tool_log() -> Iterator[list[tuple[str, Any]]]:
    yield []


def _agent(model: Any, log: list[tuple[str, Any]], brace: int) -> Any:
    @function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        log.append(("get_weather", city))
        return "sunny"

    @function_tool
    def get_time(zone: Annotated[str, Field(pattern="^(UTC|CET)$")]) -> str:
        """The time in a zone."""
        log.append(("get_time", zone))
        return "noon"

    return Agent(
        name="forecaster",
        instructions="Call a tool, then answer with a forecast.",
        tools=[get_weather, get_time],
        output_type=Forecast,
        model=model,
        # The first turn must call a tool; the SDK then resets tool_choice to auto, where the
        # output is calls or the Forecast. Random weights would call forever: a bias towards
        # "{" lets the second turn answer (it cannot stop the forced first call).
        model_settings=ModelSettings(
            tool_choice="required",
            temperature=0,
            max_tokens=120,
            parallel_tool_calls=False,
            extra_body={"logit_bias": {str(brace): 30}},
        ),
    )


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_runs_tools_and_returns_the_type(
    server: ServerProcess,
    model_name: str,
    api: str,
    tool_log: list[tuple[str, Any]],
    tiny_model_path: Path,
):
    brace = AutoTokenizer.from_pretrained(tiny_model_path).convert_tokens_to_ids("{")

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    if api == "responses":
        model: Any = OpenAIResponsesModel(model=model_name, openai_client=client)
    else:
        model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    result = Runner.run_sync(_agent(model, tool_log, brace), "Weather in Paris?", max_turns=4)
    assert isinstance(result.final_output, Forecast)
    assert tool_log, "no tool was called"
    for name, value in tool_log:
        if name == "get_weather":
            assert isinstance(value, str) and len(value) <= 10
        else:
            assert value in ("UTC", "CET")


@tool
def get_weather(city: City) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def chat(server: ServerProcess, model_name: str) -> Any:
    return langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model=model_name,
        temperature=0,
        max_tokens=100,
        timeout=120,
    )


def _valid_call(call: dict[str, Any]) -> None:
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], get_weather.args_schema.model_json_schema())


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_langchain_bind_tools(chat: Any, choice: str):
    message = chat.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Paris?")
    assert isinstance(message, AIMessage) and message.tool_calls
    for call in message.tool_calls:
        _valid_call(call)
    assert "<tool_call>" not in str(message.content)
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_structured_output(chat: Any):
    result = chat.with_structured_output(Forecast, method="json_schema").invoke("Forecast?")
    assert isinstance(result, Forecast)


def test_langchain_streamed_tool_calls(chat: Any):
    chunks = list(chat.bind_tools([get_weather], tool_choice="required").stream("Weather?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.tool_calls
    for call in merged.tool_calls:
        _valid_call(call)


def test_langchain_two_turn_tool_loop_hits_the_cache(chat: Any):
    bound = chat.bind_tools([get_weather], tool_choice="required")
    question = HumanMessage("Weather in Paris?")
    first = bound.invoke([question])
    call = first.tool_calls[0]
    history = [question, first, ToolMessage(json.dumps("sunny"), tool_call_id=call["id"])]
    second = chat.bind_tools([get_weather]).invoke(history)
    assert isinstance(second, AIMessage)
    prompt_before = first.usage_metadata["input_tokens"]
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    assert cached >= prompt_before - 1
