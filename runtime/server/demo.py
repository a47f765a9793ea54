"""``arbor demo``: start ``arbor serve`` on a model (the tiny test model by default), send it a
chat request and a JSON-schema request with the ``openai`` client, print both, stop it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
STARTUP_TIMEOUT_S = 300.0


def run_demo(model_path: str | None, prompt: str, max_new_tokens: int) -> int:
    """Returns 0 when both requests were answered (the JSON one may be refused by a build
    without constrained decoding, which is reported, not fatal), 1 when the server failed."""
    try:
        import openai
    except ImportError:
        print("the demo needs the openai package: pip install -c constraints.txt -e '.[dev]'")
        return 1
    from runtime.test_model import cached_test_model

    path = model_path or str(cached_test_model("tiny", "llama"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting: arbor serve --model-path {path} --port {port}")
    print(
        "(the built-in test model has random weights: its text is noise by design; the "
        "JSON-schema answer is still valid, because the grammar decides its shape)"
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "serve", "--model-path", path]
        + ["--port", str(port), "--max-total-tokens", "8192", "--log-level", "warning"]
    )
    try:
        if not _wait_ready(server, url):
            print("the server did not start")
            return 1
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120.0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_new_tokens,
            temperature=0,
        )
        print(f"\nchat  user: {prompt!r}")
        print(f"chat  assistant: {chat.choices[0].message.content!r}")
        tokens = chat.usage.completion_tokens if chat.usage else "?"
        print(f"      ({tokens} tokens, {chat.choices[0].finish_reason})")
        _json_schema_request(client, model, openai.BadRequestError)
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        print("\nserver stopped")


def _json_schema_request(client: Any, model: str, refused: type[Exception]) -> None:
    print(f"\njson_schema: {json.dumps(PERSON_SCHEMA)}")
    try:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=96,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            },
        )
    except refused as exc:
        print(f"json_schema request refused (constrained decoding unavailable here): {exc}")
        return
    choice = response.choices[0]
    print(f"json_schema output: {choice.message.content}")
    if choice.finish_reason == "length":
        print("      (stopped at max_tokens before the object was complete)")
    else:
        print(f"      parsed: {json.loads(choice.message.content)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(server: subprocess.Popen[bytes], url: str) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False
