"""``arbor demo``: start ``arbor serve`` on a model (the built-in SmolLM2-135M-Instruct by
default), and show it doing real work: a chat answer to a question with a known answer, a
JSON-schema extraction with the ``openai`` client, and a DSL program (select + fork) through
``fl.RuntimeEndpoint`` (``frontend_lang.demo``, in a process of its own: the runtime does not
import the DSL); then stop the server."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

QUESTION = "Tell me the capital of France."
KNOWN_ANSWER = "Paris"
PASSAGE = "Maria Lopez, 34, is a civil engineer who lives in Madrid."
EXTRACTION_PROMPT = f"Extract the person's name, age and city: {PASSAGE}"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
STARTUP_TIMEOUT_S = 300.0


def run_demo(model_path: str | None, prompt: str | None, max_new_tokens: int) -> int:
    """Returns 0 when every request was answered, 1 when the server failed to start or the
    program failed."""
    try:
        import openai
    except ImportError:
        print("the demo needs the openai package: pip install -c constraints.txt -e '.[dev]'")
        return 1
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "runtime.cli", "serve", "--port", str(port)]
    command += ["--max-total-tokens", "8192", "--log-level", "warning"]
    if model_path:
        command += ["--model-path", model_path]
    print("starting: arbor serve " + " ".join(command[4:]))
    server = subprocess.Popen(command)
    try:
        if not _wait_ready(server, url):
            print("the server did not start")
            return 1
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120.0)
        model = client.models.list().data[0].id
        print(f"model: {model} ({_model_path(url)})")
        _chat(client, model, prompt, max_new_tokens)
        _extraction(client, model)
        sys.stdout.flush()  # before the program's own lines
        return subprocess.run([sys.executable, "-m", "frontend_lang.demo", url]).returncode
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        print("\nserver stopped")


def _chat(client: Any, model: str, prompt: str | None, max_new_tokens: int) -> None:
    question = prompt or QUESTION
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_new_tokens,
        temperature=0,
    )
    answer = chat.choices[0].message.content or ""
    print(f"\n1. chat\n   user: {question}\n   assistant: {answer}")
    tokens = chat.usage.completion_tokens if chat.usage else "?"
    print(f"   ({tokens} tokens, finish_reason {chat.choices[0].finish_reason})")
    if prompt is None:
        verdict = "contains" if KNOWN_ANSWER in answer else "does NOT contain"
        print(f"   the answer {verdict} the known answer {KNOWN_ANSWER!r}")


def extract_person(client: Any, model: str) -> Any:
    """The demo's extraction: PASSAGE's person as PERSON_SCHEMA's JSON, greedy, with an
    ``openai`` client; returns the chat completion."""
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": EXTRACTION_PROMPT}],
        max_tokens=96,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )


def _extraction(client: Any, model: str) -> None:
    print(f"\n2. JSON-schema extraction\n   text: {PASSAGE}")
    choice = extract_person(client, model).choices[0]
    print(f"   output: {choice.message.content}")
    if choice.finish_reason == "length":
        print("   (stopped at max_tokens before the object was complete)")
    else:
        print(f"   parsed: {json.loads(choice.message.content)}")


def _model_path(url: str) -> str:
    info = httpx.get(f"{url}/get_model_info", timeout=10.0).json()
    return str(info.get("model_path", "?"))


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
