"""The fuzz suite's server and the invariant every case must keep.

After every request, whatever it was: the response is 2xx, or 4xx with the API's JSON error
(a non-empty message, no Python traceback); the server answers ``/health`` with 200; and
within ``IDLE_WITHIN_S`` no request runs or waits and no KV slot is held (the pool is back to
its baseline, cached prefixes aside).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import requests

from runtime.request_checks import INT64_MAX
from runtime.server import ServerProcess

SERVE_ARGS = ("--max-total-tokens", "8192", "--context-length", "512", "--max-n", "4")
STARTUP_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 5.0
IDLE_WITHIN_S = 15.0
# Restarts after a case killed, wedged or leaked; beyond this every case fails at once.
MAX_RESTARTS = 10
# Generated requests may ask for up to 2**63 - 1 tokens (which --context-length bounds to
# about 500, several seconds here); valid counts above this are sent as this, to keep a case
# well under a second. Invalid counts are sent as generated.
MAX_TOKENS_SENT = 4
NATIVE_TOKEN_FIELDS = ("max_new_tokens", "min_new_tokens")
OPENAI_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
# The last event of a Responses API stream, or of a Messages API stream.
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")
MESSAGE_ENDS = ("message_stop", "error")

Reply = TypeVar("Reply")


class FuzzServer:
    """One ``arbor serve`` for the fuzz suite. A case that kills, wedges or leaks it fails in
    ``check_after``; the next case gets a fresh server (``ensure_up``), so each failure (and
    each step of Hypothesis shrinking it) is reported against its own request."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.process: ServerProcess | None = None
        self.client = httpx.Client(timeout=HEALTH_TIMEOUT_S)
        self.restarts = -1
        self.tainted = False
        # True from a passed check_after until the next request: the server was just seen
        # healthy, so ensure_up need not ask /health again (one round trip less per case).
        self.checked = False

    @property
    def url(self) -> str:
        return self.ensure_up().url

    def ensure_up(self) -> ServerProcess:
        """The server, (re)started first unless it is alive and answers ``/health`` (or has
        passed ``check_after`` since the last request)."""
        if self.process is not None and not self.tainted:
            if self.checked and self.process.process.poll() is None:
                return self.process
            if self._answers():
                return self.process
        self.stop()
        self.tainted = False
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            raise AssertionError(f"the server was restarted {MAX_RESTARTS} times; giving up")
        process = ServerProcess(self.model_path, *SERVE_ARGS, startup_timeout_s=STARTUP_TIMEOUT_S)
        try:
            process.wait_ready()
        except BaseException:
            process.stop()
            raise
        self.process = process
        self.client = httpx.Client(base_url=process.url, timeout=HEALTH_TIMEOUT_S)
        return process

    def stop(self) -> None:
        self.checked = False
        self.client.close()
        if self.process is not None:
            self.process.stop()
            self.process.log_path.unlink(missing_ok=True)
            self.process = None

    def send(self, send: Callable[[], Reply], request: str) -> Reply:
        """``send()``'s reply; a stall (no reply within REQUEST_TIMEOUT_S) or a dropped
        connection fails, naming ``request``, and the next case gets a fresh server."""
        self.checked = False
        try:
            return send()
        except (httpx.HTTPError, requests.RequestException) as exc:
            self.tainted = True
            raise AssertionError(f"no reply ({exc!r}) to {request}") from None

    def check_after(self, request: str) -> None:
        """Fail, naming ``request``, unless the server is alive, answers ``/health`` with 200
        and is idle with no KV held within IDLE_WITHIN_S."""
        try:
            self._check_well(request)
        except BaseException:
            self.tainted = True
            raise
        self.checked = True

    def _check_well(self, request: str) -> None:
        process = self.process
        assert process is not None, "check_after before any request"
        if process.process.poll() is not None:
            raise AssertionError(f"the server exited after {request}\n{process.log_text()}")
        try:
            health = self.client.get("/health")
        except httpx.HTTPError as exc:
            raise AssertionError(f"/health failed after {request}: {exc!r}") from None
        assert health.status_code == 200, f"/health {health.status_code} after {request}"
        self._wait_idle(request)

    def _wait_idle(self, request: str) -> None:
        deadline = time.monotonic() + IDLE_WITHIN_S
        while True:
            info = self.client.get("/get_server_info").raise_for_status().json()
            idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
            if idle and info["kv_used_tokens"] == 0:
                return
            if time.monotonic() > deadline:
                keys = ("num_running_reqs", "num_waiting_reqs", "kv_used_tokens")
                state = {key: info[key] for key in keys}
                raise AssertionError(f"not idle {IDLE_WITHIN_S} s after {request}: {state}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.process.poll() is not None:
            return False
        try:
            return self.client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False


def check_reply(status: int, content_type: str, body: bytes, request: str) -> None:
    """Fail unless the reply is a 2xx, or a 4xx carrying the API's error with a message."""
    shown = body[:2000].decode(errors="replace")
    assert status < 500, f"{status} for {request}:\n{shown}"
    assert b"Traceback (most recent call last)" not in body, f"traceback for {request}:\n{shown}"
    if status >= 400:
        _check_error(_json(body, request), request)
    elif status == 200 and content_type.startswith("text/event-stream"):
        for event in sse_events(body, request):
            if isinstance(event, dict) and "error" in event:
                _check_error(event, request)
                assert event["error"]["type"] != "server_error", f"{request}: {event}"
    elif content_type.startswith("application/json"):
        _json(body, request)


def sse_events(body: bytes, request: str) -> list[Any]:
    """The JSON payloads of a complete server-sent event stream: ``data:`` lines ending in
    ``[DONE]``, or (the Responses and Messages APIs) ``event:`` + ``data:`` pairs ending in a
    terminal ``response.*`` event, ``message_stop`` or ``error``."""
    events: list[Any] = []
    names: list[str] = []
    for line in re.split(r"\r\n|\r|\n", body.decode()):  # not splitlines: U+0085 is no break
        if not line:
            continue
        if line.startswith("event: "):
            names.append(line[len("event: ") :])
            continue
        assert line.startswith("data: "), f"{request}: stray line {line[:200]!r}"
        data = line[len("data: ") :]
        if data == "[DONE]" and not names:
            return events
        events.append(_json(data.encode(), request))
    if names:
        assert len(names) == len(events), f"{request}: events and data lines do not pair up"
        for name, event in zip(names, events, strict=True):
            assert event.get("type") == name, f"{request}: event {name} carries {event}"
            assert event.get("code") != "server_error", f"{request}: {event}"
        ends = RESPONSE_ENDS + MESSAGE_ENDS
        assert names[-1] in ends, f"{request}: the stream ended with {names[-1]}"
        return events
    raise AssertionError(f"{request}: the stream ended without data: [DONE]")


def _json(body: bytes, request: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise AssertionError(f"not JSON for {request}: {body[:500]!r}") from None


def _check_error(reply: Any, request: str) -> None:
    error = reply.get("error") if isinstance(reply, dict) else None
    assert isinstance(error, dict), f"no error object for {request}: {reply}"
    message = error.get("message")
    assert isinstance(message, str) and message.strip(), f"no message for {request}: {reply}"
    assert isinstance(error.get("type"), str), f"no error type for {request}: {reply}"


def cap_token_counts(path: str, body: Any) -> None:
    """Lower the token counts of a request body in place (see MAX_TOKENS_SENT): counts the
    server accepts and that are larger, and the defaults, which are set explicitly (128 new
    tokens natively, also for a null ``sampling_params``; 16 in completions; the context length
    in chat). Any other value is left as generated."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        params = body.get("sampling_params", {})
        for item in params if isinstance(params, list) else [params]:
            if isinstance(item, dict):
                _cap_fields(item, NATIVE_TOKEN_FIELDS)
                item.setdefault("max_new_tokens", MAX_TOKENS_SENT)
        if body.get("sampling_params") is None:
            body["sampling_params"] = {"max_new_tokens": MAX_TOKENS_SENT}
    elif path == "/v1/completions":
        _cap_fields(body, OPENAI_TOKEN_FIELDS)
        if body.get("max_tokens") is None:
            body["max_tokens"] = MAX_TOKENS_SENT
    elif path == "/v1/chat/completions":
        _cap_fields(body, OPENAI_TOKEN_FIELDS)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_completion_tokens"] = MAX_TOKENS_SENT
    elif path == "/v1/responses":
        _cap_fields(body, ("max_output_tokens",))
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS_SENT
    elif path == "/v1/messages":
        _cap_fields(body, ("max_tokens",))  # required: a body without it is a 400


def _cap_fields(container: dict[str, Any], fields: tuple[str, ...]) -> None:
    for field in fields:
        value = container.get(field)
        if type(value) is int and MAX_TOKENS_SENT < value <= INT64_MAX:
            container[field] = MAX_TOKENS_SENT
