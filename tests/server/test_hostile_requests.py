"""The real server against a hostile client: every malformed or abusive request is refused
with a 400 in the API's error shape (never a 500, never a dead or stalled server), and the
pathological ones that are accepted give the right output without stalling other clients.

Bodies are written with ``json.dumps`` rather than httpx's encoder: a hostile client sends
lone surrogates (as ``\\ud800`` escapes) and ``Infinity``, which httpx refuses to encode.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import API_KEY, POOL, sse_payloads

pytestmark = pytest.mark.timeout(600)

JSON_HEADERS = {"Content-Type": "application/json"}
PROMPT = "def f(x):"
SHORT = {"max_new_tokens": 4}  # sampled (temperature 1), so a seed or top_k is used
GREEDY_8 = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
GREEDY_16 = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Name a prime number."}]
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
LONE_SURROGATE = "\ud800"
IDLE_WITHIN_S = 10.0
STARTUP_TIMEOUT_S = 60.0
BOMB_DEADLINE_S = 40.0
HEALTH_DEADLINE_S = 1.5
BIG_PROMPT_CHARS = 7 * 1024 * 1024


# ---- the module's server ---------------------------------------------------------------


class ModuleServer:
    """The module's server. A test that kills or wedges it fails in the autouse check, and
    the next test gets a fresh server, so each test reports on its own request. Once a
    server fails to start, every later test fails at once rather than wait for another."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.process: ServerProcess | None = None
        self.start_error: str | None = None

    def responsive(self) -> ServerProcess:
        """The server, (re)started first unless it answers /health and /get_server_info."""
        if self.start_error is not None:
            pytest.fail(f"the module server could not be restarted:\n{self.start_error}")
        if self.process is not None and _answers(self.process):
            return self.process
        self.stop()
        process = ServerProcess(self.model_path, *POOL, startup_timeout_s=STARTUP_TIMEOUT_S)
        try:
            process.wait_ready()
        except BaseException as exc:
            process.stop()
            self.start_error = str(exc)[-2000:]
            raise
        self.process = process
        return process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process.log_path.unlink(missing_ok=True)
            self.process = None


def _answers(server: ServerProcess) -> bool:
    try:
        health = httpx.get(f"{server.url}/health", timeout=5.0)
        return health.status_code == 200 and bool(server.server_info())
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def module_server(tiny_model_path: Path) -> Iterator[ModuleServer]:
    holder = ModuleServer(tiny_model_path)
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def server(module_server: ModuleServer) -> ServerProcess:
    return module_server.responsive()


@pytest.fixture(autouse=True)
def left_healthy_and_idle(server: ServerProcess) -> Iterator[None]:
    """After every test the server is alive and holds no request and no KV."""
    yield
    try:
        health = httpx.get(f"{server.url}/health", timeout=5.0)
    except httpx.HTTPError as exc:
        pytest.fail(f"/health did not answer after the test ({exc!r}); log:\n{_log_tail(server)}")
    assert health.status_code == 200, f"{health.text}\nlog:\n{_log_tail(server)}"
    _wait_idle(server, IDLE_WITHIN_S)


@pytest.fixture
def model_name(server: ServerProcess) -> str:
    response = httpx.get(f"{server.url}/v1/models", timeout=10.0)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


@pytest.fixture(scope="module")
def vocab_size(tiny_model_path: Path) -> int:
    return int(json.loads((tiny_model_path / "config.json").read_text())["vocab_size"])


# ---- helpers ---------------------------------------------------------------------------


def _wait_idle(server: ServerProcess, within: float) -> None:
    """Poll /get_server_info until no request runs or waits and no KV is held."""
    deadline = time.monotonic() + within
    info: dict[str, Any] | str = "no answer"
    while time.monotonic() < deadline:
        try:
            info = server.server_info()
        except httpx.HTTPError as exc:
            info = repr(exc)
        else:
            busy = info["num_running_reqs"], info["num_waiting_reqs"], info["kv_used_tokens"]
            if busy == (0, 0, 0):
                return
        time.sleep(0.1)
    pytest.fail(f"not idle {within} s after the test: {info}\nlog:\n{_log_tail(server)}")


def _log_tail(server: ServerProcess) -> str:
    return server.log_text()[-2000:]


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _post(server: ServerProcess, path: str, body: Any, timeout: float = 30.0) -> httpx.Response:
    """POST a JSON value (or raw bytes) to the server."""
    return httpx.post(
        f"{server.url}{path}", content=_encode(body), headers=JSON_HEADERS, timeout=timeout
    )


def _refusal(response: httpx.Response) -> dict[str, Any]:
    """The error of a 400 in the API's one error shape, checked; fails with the body else."""
    assert response.status_code == 400, (response.status_code, response.text[:2000])
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    message = error["message"]
    assert isinstance(message, str) and message.strip(), error
    assert "Traceback" not in message and "internal error" not in message, message
    return error


def _output_ids(server: ServerProcess, text: str, params: dict[str, Any]) -> list[int]:
    response = _post(server, "/generate", {"text": text, "sampling_params": params})
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


def _native(**params: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {**SHORT, **params}}


def _deep_schema(depth: int) -> dict[str, Any]:
    """An object schema nesting ``depth`` objects (about 50 bytes a level)."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


DEEP_SCHEMA = _deep_schema(100)


# ---- refused with a 400 naming the field -----------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(_native(seed=2**64), "sampling_params.seed", id="seed-2**64"),
        pytest.param(_native(top_k=2**64), "sampling_params.top_k", id="top_k-2**64"),
        pytest.param(_native(stop_regex=[5]), "sampling_params.stop_regex", id="stop_regex-int"),
        pytest.param(
            _native(stop=LONE_SURROGATE), "sampling_params.stop", id="stop-lone-surrogate"
        ),
        pytest.param(
            _native(skip_special_tokens="no"),
            "sampling_params.skip_special_tokens",
            id="skip_special_tokens-string",
        ),
        pytest.param(_native(stop=5), "sampling_params.stop", id="stop-5"),
        pytest.param(_native(stop_token_ids=5), "sampling_params.stop_token_ids", id="stop_ids-5"),
        pytest.param(_native(choice=5), "sampling_params.choice", id="choice-5"),
        pytest.param(_native(ignore_eos="no"), "sampling_params.ignore_eos", id="ignore_eos-str"),
        pytest.param(
            _native(temperature=float("inf")), "sampling_params.temperature", id="temp-Infinity"
        ),
        pytest.param(_native(n=10000), "sampling_params.n", id="n-10000"),
        pytest.param(
            _native(max_new_tokens=10**12),
            "sampling_params.max_new_tokens",
            id="max_new_tokens-past-the-context",
        ),
        pytest.param(
            _native(stop=[f"stop-{i}" for i in range(10000)]),
            "sampling_params.stop",
            id="stop-10000-strings",
        ),
        pytest.param(
            {"text": f"x{LONE_SURROGATE}y", "sampling_params": SHORT},
            "text",
            id="text-lone-surrogate",
        ),
        pytest.param(
            {"text": PROMPT, "rid": LONE_SURROGATE, "sampling_params": SHORT},
            "rid",
            id="rid-lone-surrogate",
        ),
    ],
)
def test_native_request_refused(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    assert _refusal(_post(server, "/generate", body))["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "seed": 2**64},
            "seed",
            id="chat-seed-2**64",
        ),
        pytest.param(
            "/v1/completions", {"prompt": [-1], "max_tokens": 4}, "prompt", id="prompt-negative-id"
        ),
        pytest.param(
            "/v1/completions", {"prompt": [2**70], "max_tokens": 4}, "prompt", id="prompt-id-2**70"
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 10**12},
            "max_tokens",
            id="completion-max_tokens-past-the-context",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 10**12},
            "max_tokens",
            id="chat-max_tokens-past-the-context",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 8190},  # the context is 8192
            "max_completion_tokens",
            id="chat-max_completion_tokens-past-the-context",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 0},
            "max_tokens",
            id="chat-max_tokens-0",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": []}]},
            "messages.0.content",
            id="chat-empty-content-list",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [CHAT_TOOL, CHAT_TOOL]},
            "tools",
            id="chat-duplicate-tool-names",
        ),
        pytest.param(
            "/v1/responses",
            {"input": "hi", "max_output_tokens": 10**12},
            "max_output_tokens",
            id="responses-max_output_tokens-past-the-context",
        ),
        pytest.param(
            "/v1/responses",
            {"input": [{"role": "user", "content": []}]},
            "input.0.content",
            id="responses-empty-content-list",
        ),
        pytest.param(
            "/v1/responses",
            {"input": "hi", "tools": [RESPONSES_TOOL, RESPONSES_TOOL]},
            "tools",
            id="responses-duplicate-tool-names",
        ),
        pytest.param(
            "/v1/responses",
            {"input": "hi", "include": ["message.output_text.logprobz"]},
            "include",
            id="responses-unknown-include",
        ),
        pytest.param(
            "/v1/responses",
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input.0.call_id",
            id="responses-output-of-no-call",
        ),
    ],
)
def test_openai_request_refused(
    server: ServerProcess, model_name: str, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(server, path, {"model": model_name, **body})
    assert _refusal(response)["param"] == param


def test_an_output_of_a_call_the_previous_response_did_not_make_is_refused(
    server: ServerProcess, model_name: str
) -> None:
    first = _post(
        server, "/v1/responses", {"model": model_name, "input": "hi", "max_output_tokens": 2}
    )
    assert first.status_code == 200, first.text
    answer = {"type": "function_call_output", "call_id": "call_x", "output": "1"}
    body = {"model": model_name, "previous_response_id": first.json()["id"], "input": [answer]}
    assert _refusal(_post(server, "/v1/responses", body))["param"] == "input.0.call_id"


def test_a_join_of_an_unknown_fork_is_refused(server: ServerProcess) -> None:
    ops = [{"type": "text", "text": PROMPT}, {"type": "join", "id": 7}]
    error = _refusal(_post(server, "/program", {"branches": {"": ops}}))
    assert "no fork with id 7" in error["message"] and "branches[''][1].id" in error["message"]


def test_max_tokens_that_fit_beside_the_prompt_are_taken(
    server: ServerProcess, model_name: str
) -> None:
    """Only what does not fit is refused: the most that fits runs (ended by its grammar)."""
    ids = [1, 2, 3]
    body = {"model": model_name, "prompt": ids, "max_tokens": 8192 - len(ids), "regex": "[ab]"}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in ("a", "b")


def test_chat_content_with_lone_surrogate_refused(server: ServerProcess, model_name: str) -> None:
    messages = [{"role": "user", "content": f"hi {LONE_SURROGATE}"}]
    body = {"model": model_name, "messages": messages, "max_tokens": 4}
    param = _refusal(_post(server, "/v1/chat/completions", body))["param"]
    assert isinstance(param, str) and param.startswith("messages.0"), param


def test_body_nested_100000_deep_refused(server: ServerProcess) -> None:
    body = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _refusal(_post(server, "/generate", body))


# ---- grammars the server cannot or must not compile ------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/generate", _native(json_schema=DEEP_SCHEMA), id="native-deep-schema"),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "max_tokens": 8,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": DEEP_SCHEMA},
                },
            },
            id="chat-response_format-deep-schema",
        ),
        pytest.param(
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "max_tokens": 8,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}
                ],
                "tool_choice": "required",
            },
            id="chat-tool-deep-parameters",
        ),
        pytest.param("/generate", _native(json_schema={"$ref": "#"}), id="schema-ref-self"),
        pytest.param(
            "/generate",
            _native(
                json_schema={
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            id="schema-ref-loop",
        ),
        pytest.param("/generate", _native(ebnf="root ::= root"), id="ebnf-root-is-root"),
    ],
)
def test_grammar_refused(
    server: ServerProcess, model_name: str, path: str, body: dict[str, Any]
) -> None:
    if path.startswith("/v1/"):
        body = {"model": model_name, **body}
    _refusal(_post(server, path, body))


def test_json_object_with_every_token_banned_refused(
    server: ServerProcess, vocab_size: int
) -> None:
    banned = {str(token): float("-inf") for token in range(vocab_size)}
    body = _native(json_object=True, logit_bias=banned)
    assert b"-Infinity" in _encode(body)
    _refusal(_post(server, "/generate", body))


# ---- accepted, with the right output ---------------------------------------------------


def test_max_int64_seed_with_two_samples(server: ServerProcess) -> None:
    body = _native(seed=2**63 - 1, n=2, ignore_eos=True)
    first, again = (_post(server, "/generate", body) for _ in range(2))
    assert first.status_code == 200, first.text
    results = first.json()
    assert isinstance(results, list) and len(results) == 2, results
    assert [len(r["output_ids"]) for r in results] == [4, 4]
    assert again.status_code == 200, again.text
    assert [r["output_ids"] for r in again.json()] == [r["output_ids"] for r in results]


@pytest.mark.parametrize("temperature", [1e-50, 1e-40])
def test_tiny_temperature_is_greedy(server: ServerProcess, temperature: float) -> None:
    greedy = _output_ids(server, PROMPT, GREEDY_8)
    assert _output_ids(server, PROMPT, {**GREEDY_8, "temperature": temperature}) == greedy


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_huge_logit_bias_forces_the_token(server: ServerProcess, temperature: float) -> None:
    params = {**GREEDY_8, "temperature": temperature, "logit_bias": {"5": 1e308}}
    assert _output_ids(server, PROMPT, params) == [5] * 8


# ---- expensive constraints do not stall other clients ----------------------------------


async def _greedy_latency(client: httpx.AsyncClient) -> float:
    start = time.monotonic()
    response = await client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY_16})
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] == 16
    return time.monotonic() - start


def _check_bomb_output(constraint: dict[str, Any], prefix: str, result: dict[str, Any]) -> None:
    """Any output of a constrained request is a prefix of a match (``prefix`` matches every
    such prefix); one that finished by matching matches the constraint itself."""
    text = result["text"]
    assert re.fullmatch(prefix, text), text
    if result["meta_info"]["finish_reason"]["type"] != "stop":
        return
    if "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    if "json_schema" in constraint:
        value = json.loads(text)
        assert isinstance(value, str), text
        assert re.search(constraint["json_schema"]["pattern"], value), value  # unanchored


@pytest.mark.parametrize(
    ("constraint", "prefix"),
    [
        pytest.param({"regex": "a{100000}"}, "a*", id="regex-a-times-100000"),
        pytest.param({"regex": "[ab]*a[ab]{16}"}, "[ab]*", id="regex-dfa-blowup"),
        pytest.param(
            {"json_schema": {"type": "string", "pattern": "a{100000}"}},
            '"a*"?',
            id="schema-pattern-a-times-100000",
        ),
        pytest.param(
            {"json_schema": {"type": "string", "pattern": "[ab]*a[ab]{16}"}},
            '"[ab]*"?',
            id="schema-pattern-dfa-blowup",
        ),
        pytest.param({"stop_regex": "a{3000}"}, "(?s:.*)", id="stop_regex-a-times-3000"),
    ],
)
def test_costly_constraint_does_not_stall_others(
    server: ServerProcess, constraint: dict[str, Any], prefix: str
) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 32, **constraint},
    }

    async def race() -> tuple[float, float | None, httpx.Response | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=BOMB_DEADLINE_S) as client:
            alone = sorted([await _greedy_latency(client) for _ in range(3)])[1]
            sent = time.monotonic()
            bomb = asyncio.create_task(
                client.post("/generate", content=_encode(body), headers=JSON_HEADERS)
            )
            await asyncio.sleep(0.2)  # let the constraint reach the scheduler first
            together: float | None = None
            try:
                together = await asyncio.wait_for(_greedy_latency(client), 2 * alone + 1.0)
            except TimeoutError:
                pass
            answer: httpx.Response | None = None
            try:
                left = BOMB_DEADLINE_S - (time.monotonic() - sent)
                answer = await asyncio.wait_for(bomb, max(left, 0.0))
            except TimeoutError:
                pass
            return alone, together, answer

    alone, together, answer = asyncio.run(race())
    assert answer is not None, f"the constrained request got no answer in {BOMB_DEADLINE_S} s"
    assert answer.status_code in (200, 400), (answer.status_code, answer.text[:2000])
    if answer.status_code == 400:
        _refusal(answer)
    else:
        _check_bomb_output(constraint, prefix, answer.json())
    assert together is not None, (
        f"a greedy request took over {2 * alone + 1.0:.2f} s beside the constrained one "
        f"(alone: {alone:.3f} s)"
    )


def test_big_prompt_does_not_block_health(server: ServerProcess) -> None:
    text = ("hello world " * (BIG_PROMPT_CHARS // 12 + 1))[:BIG_PROMPT_CHARS]
    body = _encode({"text": text, "sampling_params": SHORT})
    assert len(body) < server.server_info()["max_request_bytes"]

    async def run() -> tuple[httpx.Response, list[tuple[int | None, float]]]:
        async with httpx.AsyncClient(base_url=server.url) as client:
            big = asyncio.create_task(
                client.post("/generate", content=body, headers=JSON_HEADERS, timeout=120.0)
            )
            polls: list[tuple[int | None, float]] = []
            while True:
                start = time.monotonic()
                try:
                    status: int | None = (
                        await client.get("/health", timeout=HEALTH_DEADLINE_S)
                    ).status_code
                except httpx.TimeoutException:
                    status = None
                polls.append((status, round(time.monotonic() - start, 3)))
                if big.done():
                    return await big, polls
                await asyncio.sleep(0.2)

    response, polls = asyncio.run(run())
    slow = [(status, took) for status, took in polls if status != 200 or took > HEALTH_DEADLINE_S]
    assert not slow, f"{len(slow)} of {len(polls)} health checks failed or were slow: {slow}"
    _refusal(response)


# ---- request ids -----------------------------------------------------------------------


def test_rid_reused_after_disconnect_gets_its_own_result(server: ServerProcess) -> None:
    prompt = "class Point:"
    reference = _output_ids(server, prompt, GREEDY_8)
    wrong: list[str] = []
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        for attempt in range(15):
            rid = f"reused-{uuid.uuid4().hex}"
            first = {"text": "while True:", "sampling_params": LONG, "stream": True, "rid": rid}
            with httpx.stream("POST", f"{server.url}/generate", json=first, timeout=30.0) as stream:
                assert stream.status_code == 200, stream.read()
                next(sse_payloads(stream.iter_lines()))
            retry = client.post(
                "/generate", json={"text": prompt, "sampling_params": GREEDY_8, "rid": rid}
            )
            if retry.status_code == 400:
                _refusal(retry)
            elif retry.status_code != 200 or retry.json()["output_ids"] != reference:
                wrong.append(f"attempt {attempt}: {retry.status_code} {retry.text[:300]}")
    assert not wrong, f"{len(wrong)} of 15 retries got another result: {wrong}"
    _wait_idle(server, IDLE_WITHIN_S)


# ---- authentication --------------------------------------------------------------------


def test_bearer_scheme_is_case_insensitive(keyed_server: ServerProcess) -> None:
    def models(authorization: str) -> int:
        headers = {"Authorization": authorization}
        return httpx.get(f"{keyed_server.url}/v1/models", headers=headers, timeout=10.0).status_code

    assert models(f"Bearer {API_KEY}") == 200
    assert models(f"bearer {API_KEY}") == 200
    assert models("bearer wrong") == 401
    assert models("Bearer wrong") == 401
