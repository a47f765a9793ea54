"""The DRY fields on every API: the native ``sampling_params``, extension fields on chat
completions, the Responses API and the Messages API; each changes the output (Responses as
chat does) and refuses an out-of-range value with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from runtime.server import ServerProcess
from tests.runtime.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)

# The tiny model repeats itself on this prompt; without breakers DRY changes its output.
PROMPT = "one two three one two three one two three"
DRY = {"dry_multiplier": 2.0, "dry_allowed_length": 1, "dry_sequence_breakers": []}
MESSAGES = [{"role": "user", "content": PROMPT}]
N = 24


def _native(server: ServerProcess, params: dict[str, Any]) -> httpx.Response:
    sampling = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True} | params
    body = {"text": PROMPT, "sampling_params": sampling}
    return httpx.post(f"{server.url}/generate", json=body, timeout=120.0)


def _chat(client: openai.OpenAI, model: str, extra: dict[str, Any]) -> str:
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return chat.choices[0].message.content or ""


def test_every_api_applies_the_penalty(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    plain = _native(server, {}).json()["output_ids"]
    penalised = _native(server, DRY).json()["output_ids"]
    assert penalised != plain
    chat = _chat(client, model, DRY)
    assert chat != _chat(client, model, {})
    # The same user turn through the Responses API: the same prompt, the same penalty.
    response = client.responses.create(
        model=model, input=PROMPT, max_output_tokens=N, temperature=0,
        extra_body={"ignore_eos": True, **DRY},
    )  # fmt: skip
    assert response.output_text == chat


def test_output_only_reaches_the_sampler(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """A token prompt ending inside the model's own loop: the penalty over the output alone
    differs from the one over the whole context, alike on /generate and completions."""
    dry = {"dry_multiplier": 0.8, "dry_sequence_breakers": []}
    start = random_prompts([12], seed=11)[0]
    ids = start + _native_ids(server, start, {"max_new_tokens": 28})
    output_only = _native_ids(server, ids, dry | {"dry_output_only": True})
    assert output_only != _native_ids(server, ids, dry)
    completion = client.completions.create(
        model=model, prompt=ids, max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True, **dry, "dry_output_only": True},
    )  # fmt: skip
    native = httpx.post(
        f"{server.url}/generate",
        json={"input_ids": ids, "sampling_params": _GREEDY | dry | {"dry_output_only": True}},
        timeout=120.0,
    ).json()
    assert completion.choices[0].text == native["text"]


_GREEDY = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}


def _native_ids(server: ServerProcess, ids: list[int], params: dict[str, Any]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": _GREEDY | params}
    return httpx.post(f"{server.url}/generate", json=body, timeout=120.0).json()["output_ids"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_multiplier", -1.0),
        ("dry_base", 0.5),
        ("dry_allowed_length", 0),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", [""]),
        ("dry_output_only", "yes"),
    ],
)
def test_out_of_range_is_a_400_naming_the_field(
    server: ServerProcess, client: openai.OpenAI, model: str, field: str, value: Any
) -> None:
    native = _native(server, {field: value})
    assert native.status_code == 400 and field in native.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as chat:
        _chat(client, model, {field: value})
    assert chat.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(
            model=model, input=PROMPT, max_output_tokens=2, extra_body={field: value}
        )
    assert field in str(responses.value)
    messages = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": model, "max_tokens": 2, "messages": MESSAGES, field: value},
        timeout=60.0,
    )
    assert messages.status_code == 400 and field in messages.text
