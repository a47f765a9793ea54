"""The OpenAPI document describes the request bodies exactly as the server parses them: the
fuzzers generate from it, so a bound it omits goes untested and one it invents is a false
alarm."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import schemathesis
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from runtime.request_checks import INT64_MAX
from runtime.server.http_app import create_app
from runtime.server.openai_protocol import ChatCompletionRequest
from runtime.server.openapi import REQUEST_BODIES, openapi_document
from runtime.server.protocol import GenerateReqInput

MODEL_NAME = "tiny"
MODEL_PATH = "/models/tiny"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app() -> Any:
    args = SimpleNamespace(
        api_key=None,
        admin_api_key=None,
        api_keys_file=None,
        model_name=MODEL_NAME,
        model_path=MODEL_PATH,
    )
    return create_app(SimpleNamespace(args=args, tracing=None))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def document(app: Any) -> dict[str, Any]:
    return openapi_document(app)


def _body_schema(document: dict[str, Any], path: str) -> dict[str, Any]:
    """The request body schema of POST ``path``, with the components it refers to."""
    content = document["paths"][path]["post"]["requestBody"]["content"]
    return {**content["application/json"]["schema"], "components": document["components"]}


def test_served_at_openapi_json_and_valid_openapi_3_1(app: Any, document: dict[str, Any]):
    response = TestClient(app).get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == document
    assert openapi_document(app) is document  # built once
    assert document["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(document).validate()
    operation_ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))
    assert "/openapi.json" not in document["paths"]


def test_post_routes_declare_their_bodies_and_error_responses(document: dict[str, Any]):
    for path, model in REQUEST_BODIES.items():
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model.__name__}"
        }
        assert {"200", "400", "404", "413"} <= set(operation["responses"])
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]
        shape = "AnthropicError" if path.startswith("/v1/messages") else "Error"
        assert error == {"$ref": f"#/components/schemas/{shape}"}
    detail = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert detail["required"] == ["message", "type", "param", "code"]
    anthropic = document["components"]["schemas"]["AnthropicError"]
    assert anthropic["required"] == ["type", "error"]
    assert anthropic["properties"]["error"]["required"] == ["type", "message"]


def test_sampling_params_carry_their_bounds(document: dict[str, Any]):
    schema = document["components"]["schemas"]["SamplingParamsInput"]
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    tokens = props["max_new_tokens"]
    assert (tokens["type"], tokens["minimum"], tokens["maximum"]) == ("integer", 0, INT64_MAX)
    assert props["temperature"]["minimum"] == 0.0
    assert props["top_p"]["exclusiveMinimum"] == 0.0 and props["top_p"]["maximum"] == 1.0
    assert props["top_k"]["minimum"] == -1
    assert props["n"]["minimum"] == 1
    assert props["repetition_penalty"]["maximum"] == 2.0**16
    # Optional since json_format: unset, json_format decides the layout.
    assert props["grammar_max_whitespace"]["anyOf"][0]["maximum"] == 64
    assert props["json_format"]["anyOf"][0]["enum"] == ["aligned", "compact"]
    stop_list = next(s for s in props["stop"]["anyOf"] if s.get("type") == "array")
    assert stop_list["maxItems"] == 64 and stop_list["items"]["maxLength"] == 1024


def test_model_is_the_served_one(document: dict[str, Any]):
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = document["components"]["schemas"][name]["properties"]["model"]
        assert model["enum"] == [MODEL_NAME, MODEL_PATH]
    parameter = document["paths"]["/v1/models/{model}"]["get"]["parameters"][0]
    assert parameter["schema"]["enum"] == [MODEL_NAME, MODEL_PATH]


BODIES: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"top_p": 1.0}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"top_p": 0.0}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"temperature": -0.5}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"n": 0}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"max_new_tokens": 2**63}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"stop": [""]}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": {"colour": 1}}),
    ("/generate", GenerateReqInput, {"text": "x", "sampling_params": [{}, {"seed": 2**63}]}),
    ("/generate", GenerateReqInput, {"input_ids": [[1, 2], [3]], "rid": ["a", "b"]}),
    ("/generate", GenerateReqInput, {"text": "x", "rid": ""}),
    ("/generate", GenerateReqInput, {"text": "x", "top_logprobs_num": 1025}),
    ("/generate", GenerateReqInput, {"text": "x", "stream": "yes"}),
    ("/generate", GenerateReqInput, {"text": "x", "input_ids": [1]}),
    ("/generate", GenerateReqInput, {"text": None, "input_ids": [1]}),
    ("/generate", GenerateReqInput, {"sampling_params": {}}),
    ("/v1/chat/completions", ChatCompletionRequest, {"model": MODEL_NAME, "messages": CHAT}),
    ("/v1/chat/completions", ChatCompletionRequest, {"model": MODEL_NAME, "messages": []}),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": CHAT, "n": None, "stream": None, "logprobs": None},
    ),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": CHAT, "top_p": 1.5},
    ),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "hi"}]},
    ),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": CHAT, "response_format": {"type": "json_schema"}},
    ),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": CHAT, "tool_choice": "maybe"},
    ),
    (
        "/v1/chat/completions",
        ChatCompletionRequest,
        {"model": MODEL_NAME, "messages": CHAT, "seed": None, "colour": "red"},
    ),
]


def _accepted(model: type[BaseModel], body: dict[str, Any]) -> bool:
    """Whether the server parses ``body``: the model validates it, and for /generate the
    handler's own check passes (exactly one of text and input_ids)."""
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    if model is GenerateReqInput:
        return (body.get("text") is None) != (body.get("input_ids") is None)
    return True


@pytest.mark.parametrize(("path", "model", "body"), BODIES)
def test_schema_accepts_what_the_server_accepts(
    document: dict[str, Any], path: str, model: type[BaseModel], body: dict[str, Any]
):
    accepted = _accepted(model, body)
    schema = _body_schema(document, path)
    assert jsonschema.Draft202012Validator(schema).is_valid(body) == accepted, body
