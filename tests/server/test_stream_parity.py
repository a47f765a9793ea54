"""Streaming parity end to end: for every tool-call format, with speculation off, with n-gram
speculation and with a draft model, the concatenated stream of a chat completion and of a
Responses API response equals the response returned whole — content, reasoning, and each
call's index, name and arguments (call ids are per request, so not compared) — including a
call cut off by max_tokens, which both keep (finish_reason "length", status "incomplete").

Per format, one model with that format's chat template serves twice at once: with n-gram
speculation (a request's ``no_speculation`` opt-out gives the run without speculation) and
with a draft cut from the model. Each speculating run must have accepted draft tokens, so
several tokens land in one step — the case that loses arguments in other servers. The
thinking test model (deepseek-r1 parser) does the same with its reasoning before the calls.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.server import ServerProcess
from runtime.test_model import CHAT_TEMPLATES, cached_draft_model, cached_test_model
from tests.server.server_process import POOL, sse_payloads
from tests.server.test_server_tool_calls import CALLS_TEXT
from tests.tool_fixtures import responses_tool, time_tool, weather_tool

pytestmark = pytest.mark.timeout(600)

TOOLS = [weather_tool(8), time_tool({"type": "string", "maxLength": 4})]
SYSTEM, USER = "You are terse.", "Weather in Paris, and the time?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
SPECULATION = ("off", "ngram", "draft")
SPEC_FLAGS = ("--speculative-num-draft-tokens", "4", "--speculative-policy", "always")

# Per template: max_tokens that cut the test model's second (or later) call, never
# between calls.
CUT_TOKENS = {"chatml": 80, "plain": 100, "llama3": 100, "mistral": 70}
Call = tuple[int, str, str]  # index, name, arguments


class FormatServers:
    """One template's model served twice: n-gram speculation and a draft model."""

    def __init__(self, template: str, ngram: ServerProcess, draft: ServerProcess) -> None:
        self.template = template
        self.ngram, self.draft = ngram, draft
        self.model = httpx.get(f"{ngram.url}/v1/models", timeout=10.0).json()["data"][0]["id"]

    def url(self, speculation: str) -> str:
        return (self.draft if speculation == "draft" else self.ngram).url


def start_pair(path: Path, extra: tuple[str, ...] = ()) -> tuple[ServerProcess, ServerProcess]:
    """Both servers of one model, started side by side (each stopped by the caller)."""
    ngram = ServerProcess(path, *POOL, *extra, "--speculative-algorithm", "ngram", *SPEC_FLAGS)
    try:
        draft = ServerProcess(
            path, *POOL, *extra, "--speculative-algorithm", "draft",
            "--speculative-draft-model-path", str(cached_draft_model(path)), *SPEC_FLAGS,
        )  # fmt: skip
    except BaseException:
        ngram.stop()
        raise
    return ngram, draft


def stop_pair(*servers: ServerProcess) -> None:
    """Stop the servers side by side (each waits for its processes to exit)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for done in [pool.submit(server.stop) for server in servers]:
            done.result()


class PairLauncher:
    """The module's server pairs, each started (on a thread: a draft model may be cut first)
    while the tests of the pair before it run, so that a pair's start overlaps requests to
    the previous one instead of following them. The order is that of the collected tests: a
    pair no selected test uses never starts."""

    def __init__(self, order: list[str], paths: dict[str, Path]) -> None:
        self.order = order
        self.paths = paths
        self.ahead: dict[str, Future[tuple[ServerProcess, ServerProcess]]] = {}
        self.starter = ThreadPoolExecutor(1, thread_name_prefix="stream-parity-start")
        self.stopper = ThreadPoolExecutor(1, thread_name_prefix="stream-parity-stop")
        self.stopping: list[Future[None]] = []

    def take(self, key: str) -> tuple[ServerProcess, ServerProcess]:
        """``key``'s pair, ready (started now unless it was started ahead); the next key's
        pair starts before this returns. The caller stops the pair it takes."""
        started = self.ahead.pop(key, None)
        ngram, draft = started.result() if started is not None else self._start(key)
        try:
            ngram.wait_ready()
            draft.wait_ready()
        except BaseException:
            stop_pair(ngram, draft)
            raise
        later = self.order[self.order.index(key) + 1 :] if key in self.order else []
        if later and later[0] not in self.ahead:
            self.ahead[later[0]] = self.starter.submit(self._start, later[0])
        return ngram, draft

    def retire(self, ngram: ServerProcess, draft: ServerProcess) -> None:
        """Stop a taken pair on a thread while the next pair's tests run (``stop_all`` waits)."""
        self.stopping.append(self.stopper.submit(stop_pair, ngram, draft))

    def stop_all(self) -> None:
        """Wait for the retired pairs to stop; stop the pairs started ahead and never taken."""
        self.starter.shutdown(wait=True)
        pairs = [started.result() for started in self.ahead.values() if not started.exception()]
        self.ahead = {}
        try:
            if pairs:
                stop_pair(*(server for pair in pairs for server in pair))
        finally:
            self.stopper.shutdown(wait=True)
            for stopped in self.stopping:
                stopped.result()

    def _start(self, key: str) -> tuple[ServerProcess, ServerProcess]:
        if key == THINKING:
            return start_pair(self.paths[key], ("--reasoning-parser", "deepseek-r1"))
        return start_pair(self.paths[key])


THINKING = "thinking"


def pair_order(session: pytest.Session, module: object) -> list[str]:
    """The pairs this module's collected tests use, in the order they run."""
    order: list[str] = []
    for item in session.items:
        if getattr(item, "module", None) is not module:
            continue
        params = getattr(item, "callspec", None)
        key = params.params.get("servers") if params is not None else None
        if key is None and "thinking" in getattr(item, "fixturenames", ()):
            key = THINKING
        if key is not None and key not in order:
            order.append(key)
    return order


@pytest.fixture(scope="module")
def launcher(request: pytest.FixtureRequest) -> Iterator[PairLauncher]:
    order = pair_order(request.session, request.module)
    # Models are built here, on the main thread, before any pair starts.
    paths = {
        key: request.getfixturevalue("thinking_model_path")
        if key == THINKING
        else cached_test_model("tiny", "llama", chat_template=key)
        for key in order
    }
    pairs = PairLauncher(order, paths)
    try:
        yield pairs
    finally:
        pairs.stop_all()


@pytest.fixture(scope="module", params=sorted(CALLS_TEXT))
def servers(request: pytest.FixtureRequest, launcher: PairLauncher) -> Iterator[FormatServers]:
    template = request.param
    ngram, draft = launcher.take(template)
    try:
        yield FormatServers(template, ngram, draft)
    finally:
        launcher.retire(ngram, draft)


def spec_stats(url: str) -> tuple[int, int, int]:
    """(accepted draft tokens, generated tokens, steps that gave a request tokens) so far."""
    info = httpx.get(f"{url}/get_server_info", timeout=10.0).json()
    return info["spec_accepted_tokens"], info["generated_tokens"], info["emit_steps"]


def check_speculated(url: str, before: tuple[int, int, int], speculation: str) -> None:
    """Speculating runs accepted drafts, so some step gave a request several tokens; the
    opted-out run accepted none."""
    accepted, generated, steps = (b - a for a, b in zip(before, spec_stats(url), strict=True))
    if speculation == "off":
        assert accepted == 0
    else:
        assert accepted > 0 and generated > steps, (accepted, generated, steps)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(f"{url}{path}", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response


def streamed(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON payloads of a streamed request (Responses events carry their type too)."""
    payloads: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120.0) as response:
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if not line.startswith("event: "))
        if path == "/v1/chat/completions":
            payloads = list(sse_payloads(lines))
        else:
            payloads = [json.loads(line[len("data: ") :]) for line in lines if line]
    return payloads


# ---- chat completions ------------------------------------------------------------------


def chat_whole(body: dict[str, Any]) -> tuple[str, str, list[Call], str]:
    """(content, reasoning, calls, finish reason) of a whole chat response."""
    [choice] = body["choices"]
    message = choice["message"]
    calls = [
        (i, call["function"]["name"], call["function"]["arguments"])
        for i, call in enumerate(message.get("tool_calls") or [])
    ]
    reasoning = message.get("reasoning_content") or ""
    return message["content"] or "", reasoning, calls, choice["finish_reason"]


def chat_stream(chunks: list[dict[str, Any]]) -> tuple[str, str, list[Call], str]:
    """The same, as a client assembles it from the chunks."""
    content = reasoning = ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for piece in delta.get("tool_calls") or []:
            index, function = piece["index"], piece["function"]
            if "name" in function:  # a call's first delta: its id, type and name
                assert index == len(names) and piece["id"].startswith("call_")
                names[index] = function["name"]
                arguments[index] = ""
            arguments[index] += function["arguments"]
        if choice.get("finish_reason") is not None:
            assert finish is None
            finish = choice["finish_reason"]
    assert finish is not None
    calls = [(i, names[i], arguments[i]) for i in sorted(names)]
    return content, reasoning, calls, finish


# ---- Responses API ---------------------------------------------------------------------


def output_items(output: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The output items without their ids: (type, status, text) or (type, status, name,
    arguments)."""
    items: list[tuple[str, ...]] = []
    for item in output:
        kind = item["type"]
        if kind == "function_call":
            items.append((kind, item["status"], item["name"], item["arguments"]))
        else:
            text = "".join(part["text"] for part in item["content"])
            items.append((kind, item["status"], text))
    return items


def responses_stream(events: list[dict[str, Any]]) -> tuple[str, list[tuple[str, ...]]]:
    """(status, output items) as a client assembles them from the events' deltas."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    items: dict[int, dict[str, Any]] = {}
    for event in events:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            item = event["item"]
            assert index == len(items)
            items[index] = {"type": item["type"], "status": "", "text": ""}
            if item["type"] == "function_call":
                assert item["arguments"] == ""
                items[index]["name"] = item["name"]
        elif kind in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            items[index]["text"] += event["delta"]
        elif kind == "response.output_item.done":
            items[index]["status"] = event["item"]["status"]
    status = events[-1]["response"]["status"]
    assembled: list[tuple[str, ...]] = []
    for _, item in sorted(items.items()):
        if item["type"] == "function_call":
            assembled.append(("function_call", item["status"], item["name"], item["text"]))
        else:
            assembled.append((item["type"], item["status"], item["text"]))
    assert output_items(events[-1]["response"]["output"]) == assembled
    return status, assembled


def responses_calls(items: list[tuple[str, ...]]) -> list[Call]:
    calls = [item for item in items if item[0] == "function_call"]
    return [(i, item[2], item[3]) for i, item in enumerate(calls)]


# ---- the requests ----------------------------------------------------------------------


@functools.cache
def endless_bias(template: str, path: Path) -> dict[str, float]:
    """Biases that keep constrained calls coming until max_tokens (test_server_tool_calls)."""
    from transformers import AutoTokenizer

    from runtime.server.token_text import TokenText

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = TokenText(tokenizer)
    turn_end = tokenizer.convert_tokens_to_ids(CHAT_TEMPLATES[template].turn_end)
    banned = {tokenizer.eos_token_id, turn_end}
    banned |= {i for i in range(len(tokenizer)) if "]" in text.text(i)}
    return {str(i): -100.0 for i in banned}


@functools.cache
def cases(template: str) -> dict[str, dict[str, Any]]:
    """Chat options of each case (the Responses request is built from them)."""
    fmt, calls_text = CALLS_TEXT[template]
    # Content around the calls (llama3's calls are the whole turn), the text forced by regex.
    intro, outro = ("", "") if fmt == "llama3" else ("Sure. ", " Done.")
    path = cached_test_model("tiny", "llama", chat_template=template)
    return {
        "named": {
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False,
            "max_tokens": 60,
        },
        # Calls until max_tokens cuts one inside its arguments: the complete ones, then the
        # cut one (the length, per model, where the cut falls inside a call).
        "cut": {
            "tool_choice": "required",
            "max_tokens": CUT_TOKENS[template],
            "logit_bias": endless_bias(template, path),
        },
        "auto": {"max_tokens": 120, "regex": re.escape(intro + calls_text + outro)},
    }


def responses_body(model: str, options: dict[str, Any], stream: bool) -> dict[str, Any]:
    choice = options.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["function"]["name"]}
    body = {
        "model": model,
        "instructions": SYSTEM,
        "input": USER,
        "tools": [responses_tool(tool) for tool in TOOLS],
        "tool_choice": choice,
        "parallel_tool_calls": options.get("parallel_tool_calls", True),
        "max_output_tokens": options["max_tokens"],
        "temperature": 0,
        "stream": stream,
    }
    return body | ({"logit_bias": options["logit_bias"]} if "logit_bias" in options else {})


@pytest.mark.parametrize("speculation", SPECULATION)
@pytest.mark.parametrize("case", ["named", "cut", "auto"])
def test_chat_and_responses_stream_as_returned_whole(
    servers: FormatServers, case: str, speculation: str
):
    url = servers.url(speculation)
    options = cases(servers.template)[case] | {"no_speculation": speculation == "off"}
    chat = {"model": servers.model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0}
    chat |= {k: v for k, v in options.items() if k != "no_speculation"}
    chat["no_speculation"] = options["no_speculation"]
    before = spec_stats(url)
    whole = chat_whole(post(url, "/v1/chat/completions", chat).json())
    assert chat_stream(streamed(url, "/v1/chat/completions", chat | {"stream": True})) == whole
    content, _, calls, finish = whole
    assert calls, whole
    if case == "named":
        assert [name for _, name, _ in calls] == ["get_time"] and finish == "tool_calls"
        json.loads(calls[0][2])
    elif case == "cut":  # complete calls, then the cut one, kept with its partial arguments
        assert finish == "length" and len(calls) >= 2 and content == ""
        for _, _, arguments in calls[:-1]:
            json.loads(arguments)
    else:
        expected = "" if servers.template == "llama3" else "Sure. Done."
        assert (content, finish, len(calls)) == (expected, "tool_calls", 2)

    if case == "auto":  # the Responses API has no regex to force free text with
        check_speculated(url, before, speculation)
        return
    body = responses_body(servers.model, options, stream=False)
    body["no_speculation"] = options["no_speculation"]
    response = post(url, "/v1/responses", body).json()
    items = output_items(response["output"])
    status, assembled = responses_stream(streamed(url, "/v1/responses", body | {"stream": True}))
    assert (status, assembled) == (response["status"], items)
    # The same generation as chat's: the same calls, a cut one marked incomplete.
    assert responses_calls(items) == calls
    statuses = [item[1] for item in items if item[0] == "function_call"]
    if case == "cut":
        assert status == "incomplete" and statuses[-1] == "incomplete"
        assert set(statuses[:-1]) == {"completed"}
    else:
        assert status == "completed" and set(statuses) == {"completed"}
    check_speculated(url, before, speculation)


# ---- a reasoning model -----------------------------------------------------------------


# The conversation test_server_reasoning finds a closing bias for.
THINK_MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
THINK_TOOLS = [weather_tool(None)]


class ThinkingServers(FormatServers):
    """The thinking test model with --reasoning-parser deepseek-r1, served twice, and the
    sampling options under which its greedy output closes its reasoning."""

    def __init__(self, ngram: ServerProcess, draft: ServerProcess, path: Path) -> None:
        super().__init__("qwen3", ngram, draft)
        from transformers import AutoTokenizer

        from tests.server.test_server_reasoning import _sweep

        tokenizer = AutoTokenizer.from_pretrained(path)
        prompt = tokenizer.apply_chat_template(
            THINK_MESSAGES, tools=THINK_TOOLS, tokenize=False, add_generation_prompt=True
        )
        end = str(tokenizer.convert_tokens_to_ids("</think>"))
        self.options, _ = _sweep(ngram, prompt, end, [{}], min_thinking=3)


@pytest.fixture(scope="module")
def thinking(thinking_model_path: Path, launcher: PairLauncher) -> Iterator[ThinkingServers]:
    ngram, draft = launcher.take(THINKING)
    try:
        yield ThinkingServers(ngram, draft, thinking_model_path)
    finally:
        launcher.retire(ngram, draft)


@pytest.mark.parametrize("speculation", SPECULATION)
def test_reasoning_streams_as_returned_whole(thinking: ThinkingServers, speculation: str):
    """The thinking, then forced calls or a free answer: reasoning, content and calls of the
    stream equal the whole response's, in chat and in the Responses API."""
    url = thinking.url(speculation)
    sampling = thinking.options | {"temperature": 0, "no_speculation": speculation == "off"}
    before = spec_stats(url)
    for choice in ("required", "auto"):  # forced calls; a free answer (the same prompt)
        tools = {"tools": THINK_TOOLS, "tool_choice": choice}
        chat = {"model": thinking.model, "messages": THINK_MESSAGES, "max_tokens": 120}
        chat |= sampling | tools
        whole = chat_whole(post(url, "/v1/chat/completions", chat).json())
        stream = chat_stream(streamed(url, "/v1/chat/completions", chat | {"stream": True}))
        assert stream == whole
        content, reasoning, calls, finish = whole
        assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
        forced = choice == "required"
        assert bool(calls) == forced and (finish == "tool_calls") == forced
        assert bool(content) != forced
        body = {"model": thinking.model, "input": THINK_MESSAGES[0]["content"]}
        body |= {"max_output_tokens": 120, **sampling}
        body |= {"tools": [responses_tool(t) for t in THINK_TOOLS], "tool_choice": choice}
        response = post(url, "/v1/responses", body).json()
        items = output_items(response["output"])
        events = streamed(url, "/v1/responses", body | {"stream": True})
        assert responses_stream(events) == (response["status"], items)
        assert items[0] == ("reasoning", "completed", reasoning)
        assert responses_calls(items) == calls
    check_speculated(url, before, speculation)
