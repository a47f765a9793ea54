"""The ways the quality benchmark asks a running ``arbor serve`` for a task's answer.

Every mode sends the same user message (the task's prompt around the item's text; the tool
tasks' message is the user's request alone, with the tool in ``tools``), greedy, and turns the
response into a ``Generation``: the answer value it read (an object, a label or the call's
arguments; None when there is none) and the facts around it.

``json_format`` (``aligned`` | ``compact``) goes where each API takes it: ``sampling_params``
on the native API, the body's top level on the OpenAI API (with ``response_format`` and with
tools), ``fl.gen(json_format=...)`` in the DSL. A server that does not know the field refuses
it (400 naming it); a ``compact`` request is then sent again without it, which is the same
request on such a server (compact JSON is then its only format), and says so in its note; an
``aligned`` one fails as a ``Refused`` item.

``Client.sampling`` (``--sampling``: e.g. ``{"dry_multiplier": 0.8}``) goes into every request
where its sampling fields go: into ``sampling_params``, at the OpenAI body's top level, as
``fl.gen`` keywords (the DSL's ``select`` only scores, and takes none).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

import frontend_lang as fl
from benchmarks.quality_tasks import Item, Task, find_json_object, read_label, tool_arguments
from runtime.chat.tool_calls import parse_tool_calls

NO_FIELD_NOTE = "server has no json_format: sent without it (its compact JSON)"


@dataclass(frozen=True)
class Generation:
    """One item's answer: ``value`` (None when none could be read), the output's text and
    token count (None where nothing is generated: ``select`` scores the choices), whether
    ``max_tokens`` cut it, and a note (e.g. ``NO_FIELD_NOTE``)."""

    value: Any
    text: str
    output_tokens: int | None
    cut: bool
    note: str = ""


class Refused(Exception):
    """The server (or the DSL) refused the request; the message says why."""


@dataclass
class Client:
    """What the modes share: the server's HTTP client and model name, the chat prompt as the
    server renders it (for the native API, which takes text), the DSL backend, the budget."""

    http: httpx.AsyncClient
    model: str
    render_chat: Callable[[str], str]
    dsl: fl.RuntimeEndpoint
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)  # extra fields for every request


@dataclass(frozen=True)
class Mode:
    """A way of asking: ``name`` is the row's label, ``kinds`` the task kinds it applies to,
    ``constrained`` whether a grammar shapes the output, ``schema_bound`` whether the output
    is held to the task's schema (``json_object`` only promises an object)."""

    name: str
    kinds: tuple[str, ...]
    run: Callable[[Client, Task, Item], Awaitable[Generation]]
    constrained: bool = True
    schema_bound: bool = True


async def _post(
    client: Client, path: str, body: dict[str, Any], fmt: str | None
) -> tuple[dict[str, Any], str]:
    """POST with ``json_format`` set to ``fmt`` (native: inside sampling_params); returns the
    response body and the note. Raises Refused on a 4xx/5xx."""
    target = body["sampling_params"] if "sampling_params" in body else body
    target.update(client.sampling)
    if fmt is not None:
        target["json_format"] = fmt
    response = await client.http.post(path, json=body)
    note = ""
    if response.status_code == 400 and fmt == "compact" and "json_format" in response.text:
        del target["json_format"]
        response = await client.http.post(path, json=body)
        note = NO_FIELD_NOTE
    if response.status_code != 200:
        raise Refused(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json(), note


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _answer(task: Task, value: Any) -> Any:
    """A whole constrained output's value as the task reads it: the label for a label task."""
    return value if task.kind != "label" or isinstance(value, str) else None


async def _chat(
    client: Client, task: Task, item: Item, extra: dict[str, Any], fmt: str | None
) -> tuple[dict[str, Any], int, bool, str]:
    """One chat completion: the message, its output tokens, whether it was cut, the note."""
    body = {
        "model": client.model,
        "messages": [{"role": "user", "content": task.user_message(item)}],
        "temperature": 0,
        "max_tokens": client.max_tokens,
        **extra,
    }
    response, note = await _post(client, "/v1/chat/completions", body, fmt)
    choice = response["choices"][0]
    tokens = response["usage"]["completion_tokens"]
    return choice["message"], tokens, choice["finish_reason"] == "length", note


def _tools(task: Task, tool_choice: str) -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": task.tool}],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }


async def unconstrained(client: Client, task: Task, item: Item) -> Generation:
    """Free generation; the answer is read from the text (and, for tools, from a call the
    server parsed, else from a call envelope or a JSON object in the text). The tool tasks
    send ``tool_choice: auto`` with ``reply_envelope: "free"``: the prompt of auto (on a
    template without tool syntax, the generic format's envelope described), no grammar."""
    tools = task.kind in ("tool", "no_call")
    extra = _tools(task, "auto") | {"reply_envelope": "free"} if tools else {}
    message, tokens, cut, _ = await _chat(client, task, item, extra, None)
    text = message.get("content") or ""
    value: Any
    if task.kind == "no_call":
        assert task.tool is not None
        called = bool(message.get("tool_calls"))
        value = {"called": called or envelope_call_arguments(text, task.tool["name"]) is not None}
    elif task.kind == "label":
        value = read_label(text, task.labels)
    elif task.kind == "tool":
        assert task.tool is not None
        value = _call_arguments(message, task.tool["name"])
        if value is None:
            value = envelope_call_arguments(text, task.tool["name"])
        if value is None:
            value = tool_arguments(find_json_object(text), task.tool["name"])
    else:
        value = find_json_object(text)
    return Generation(value, text or json.dumps(message.get("tool_calls")), tokens, cut)


def envelope_call_arguments(text: str, tool_name: str) -> Any:
    """The first call to ``tool_name`` in a reply envelope anywhere in ``text`` (after prose,
    say), read by the server's envelope parser; None when there is none."""
    start = text.find("{")
    while start != -1:
        _, calls = parse_tool_calls(text[start:], {tool_name}, fmt="generic")
        if calls:
            return _loads(calls[0].arguments)
        start = text.find("{", start + 1)
    return None


def _call_arguments(message: dict[str, Any], tool_name: str) -> Any:
    calls = message.get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != tool_name:
        return None
    return _loads(calls[0]["function"]["arguments"])


def native_json_schema(fmt: str) -> Callable[[Client, Task, Item], Awaitable[Generation]]:
    async def run(client: Client, task: Task, item: Item) -> Generation:
        params = {
            "json_schema": json.dumps(task.output_schema),
            "temperature": 0,
            "max_new_tokens": client.max_tokens,
        }
        text = client.render_chat(task.user_message(item))
        response, note = await _post(
            client, "/generate", {"text": text, "sampling_params": params}, fmt
        )
        meta = response["meta_info"]
        cut = meta["finish_reason"]["type"] == "length"
        value = _answer(task, _loads(response["text"]))
        return Generation(value, response["text"], meta["completion_tokens"], cut, note)

    return run


async def native_choice(client: Client, task: Task, item: Item) -> Generation:
    params = {"choice": list(task.labels), "temperature": 0, "max_new_tokens": client.max_tokens}
    text = client.render_chat(task.user_message(item))
    response, _ = await _post(client, "/generate", {"text": text, "sampling_params": params}, None)
    meta = response["meta_info"]
    cut = meta["finish_reason"]["type"] == "length"
    return Generation(response["text"], response["text"], meta["completion_tokens"], cut)


def openai_response_format(
    kind: str, fmt: str
) -> Callable[[Client, Task, Item], Awaitable[Generation]]:
    """``response_format`` ``json_schema`` (the task's schema) or ``json_object``."""

    async def run(client: Client, task: Task, item: Item) -> Generation:
        response_format: dict[str, Any] = {"type": kind}
        if kind == "json_schema":
            spec = {"name": task.name, "schema": task.output_schema, "strict": True}
            response_format["json_schema"] = spec
        extra = {"response_format": response_format}
        message, tokens, cut, note = await _chat(client, task, item, extra, fmt)
        text = message.get("content") or ""
        return Generation(_answer(task, _loads(text)), text, tokens, cut, note)

    return run


def tool_call(tool_choice: str, fmt: str) -> Callable[[Client, Task, Item], Awaitable[Generation]]:
    """A chat request with the task's tool; the answer is the first call's arguments."""

    async def run(client: Client, task: Task, item: Item) -> Generation:
        assert task.tool is not None
        extra = _tools(task, tool_choice)
        message, tokens, cut, note = await _chat(client, task, item, extra, fmt)
        if task.kind == "no_call":
            text = message.get("content") or json.dumps(message.get("tool_calls"))
            return Generation({"called": bool(message.get("tool_calls"))}, text, tokens, cut, note)
        value = _call_arguments(message, task.tool["name"])
        text = json.dumps(message.get("tool_calls")) or ""
        return Generation(
            value, text if value is not None else message.get("content") or "", tokens, cut, note
        )

    return run


def dsl_json_schema(fmt: str) -> Callable[[Client, Task, Item], Awaitable[Generation]]:
    """``fl.gen(json_schema=..., json_format=fmt)`` in a one-turn program."""

    def gen(client: Client, task: Task, with_format: bool) -> fl.ir.Gen:
        kwargs: dict[str, Any] = {"json_format": fmt} if with_format else {}
        return fl.gen(
            "answer", max_tokens=client.max_tokens, temperature=0,
            json_schema=task.output_schema, **kwargs, **client.sampling,
        )  # fmt: skip

    async def run(client: Client, task: Task, item: Item) -> Generation:
        note = ""
        try:
            expr = gen(client, task, True)
        except TypeError as exc:  # this DSL has no json_format
            if fmt != "compact":
                raise Refused(f"fl.gen: {exc}") from exc
            expr, note = gen(client, task, False), NO_FIELD_NOTE
        state = await _run_program(client, _one_turn, task.user_message(item), expr)
        meta = state.get_meta_info("answer")
        text = state["answer"]
        cut = meta["finish_reason"]["type"] == "length"
        return Generation(_answer(task, _loads(text)), text, meta["completion_tokens"], cut, note)

    return run


async def dsl_select(client: Client, task: Task, item: Item) -> Generation:
    expr = fl.select("answer", choices=list(task.labels))
    state = await _run_program(client, _one_turn, task.user_message(item), expr)
    return Generation(state["answer"], state["answer"], None, False)


@fl.function
def _one_turn(s: Any, message: str, answer: Any) -> None:
    s += fl.user(message)
    s += fl.assistant(answer)


async def _run_program(client: Client, program: Any, message: str, expr: Any) -> Any:
    try:
        return await asyncio.to_thread(program.run, message, expr, backend=client.dsl)
    except fl.ProgramError as exc:
        raise Refused(f"DSL: {exc}") from exc


def all_modes() -> list[Mode]:
    """Every mode, in table order."""
    modes = [Mode("unconstrained", ("json", "label", "tool", "no_call"), unconstrained, False)]
    formats = ("aligned", "compact")
    modes += [
        Mode(f"native json_schema {f}", ("json", "label"), native_json_schema(f)) for f in formats
    ]
    modes += [
        Mode(f"openai json_schema {f}", ("json", "label"), openai_response_format("json_schema", f))
        for f in formats
    ]
    modes += [
        Mode(
            f"openai json_object {f}",
            ("json",),
            openai_response_format("json_object", f),
            schema_bound=False,
        )
        for f in formats
    ]
    modes += [Mode(f"dsl json_schema {f}", ("json", "label"), dsl_json_schema(f)) for f in formats]
    modes += [
        Mode("native choice", ("label",), native_choice),
        Mode("dsl select", ("label",), dsl_select),
    ]
    modes += [  # "required" always calls: no mode for the no_call task
        Mode(f"tools {choice} {f}", kinds, tool_call(choice, f))
        for choice, kinds in (("auto", ("tool", "no_call")), ("required", ("tool",)))
        for f in formats
    ]
    return modes
