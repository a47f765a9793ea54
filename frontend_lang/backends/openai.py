"""``fl.OpenAI``: the DSL on any OpenAI-compatible server, through the ``openai`` package.

A program without role blocks is sent to ``/v1/completions`` as text; a program with role
blocks is sent to ``/v1/chat/completions`` as messages, so a gen there must open an assistant
turn. Constraints go where OpenAI-compatible servers take them: ``json_schema`` as the chat
``response_format`` (or ``json_schema`` in the completions body, SGLang's extension);
``regex`` (choices become an alternation regex), ``top_k``, ``min_p``, ``json_format`` and the
``dry_*`` fields in
the request body.
A server that ignores a regex is caught: the output is checked against it. ``select`` needs
prompt logprobs, which only ``/v1/completions`` with ``echo`` and ``logprobs`` gives, and only
where the server supports it; otherwise it raises BackendError saying so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable
from typing import Any

import openai

from frontend_lang.backends.base import (
    Backend,
    BackendError,
    ChoiceLogprobs,
    GenOutput,
    OnDelta,
    Prompt,
)
from frontend_lang.backends.client_pool import ClientPool, shared_ssl_context
from frontend_lang.chat import CHATML, ChatTemplate
from frontend_lang.ir import DRY_FIELDS

_BODY_FIELDS = ("top_k", "min_p", "regex", "json_format", *DRY_FIELDS)


class OpenAI(Backend):
    """``fl.OpenAI(base_url="http://host:port/v1", model="name", api_key=None)``."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.model = model
        self._clients = ClientPool(
            lambda: openai.OpenAI(
                base_url=base_url,
                api_key=api_key or "none",
                max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=shared_ssl_context()),
            ),
            openai.OpenAI.close,
        )

    def shutdown(self) -> None:
        self._clients.close_all()

    @property
    def chat_template(self) -> ChatTemplate:
        """Only for the state's own text view; the server renders the messages it is sent."""
        return CHATML

    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], on_delta: OnDelta | None = None
    ) -> GenOutput:
        params = dict(sampling_params)
        request: dict[str, Any] = {"model": self.model, "stream": on_delta is not None}
        if "max_new_tokens" in params:
            request["max_tokens"] = params.pop("max_new_tokens")
        for name in ("stop", "temperature", "top_p", "frequency_penalty", "presence_penalty"):
            if name in params:
                request[name] = params.pop(name)
        choices = params.pop("choice", None)
        if choices is not None:  # OpenAI-compatible servers take choices as a regex
            params["regex"] = "(" + "|".join(re.escape(c) for c in choices) + ")"
        body = {name: params.pop(name) for name in _BODY_FIELDS if name in params}
        schema = params.pop("json_schema", None)
        if params:
            raise BackendError(f"fl.OpenAI cannot send {', '.join(sorted(params))}")
        chat = prompt.uses_roles
        if chat:
            _check_chat_turn(prompt)
            request["messages"] = prompt.messages
            if schema is not None:
                request["response_format"] = _response_format(schema)
        else:
            request["prompt"] = prompt.text
            if schema is not None:
                body["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
        if body:
            request["extra_body"] = body
        try:
            with self._clients.lease() as client:
                if on_delta is not None and chat:
                    request["stream_options"] = {"include_usage": True}
                    stream = client.chat.completions.create(**request)
                    text, meta = _collect_stream(stream, on_delta)
                elif on_delta is not None:
                    request["stream_options"] = {"include_usage": True}
                    text, meta = _collect_stream(client.completions.create(**request), on_delta)
                elif chat:
                    response = client.chat.completions.create(**request)
                    text = response.choices[0].message.content or ""
                    meta = _meta(response.usage, response.choices[0].finish_reason)
                else:
                    response = client.completions.create(**request)
                    text = response.choices[0].text
                    meta = _meta(response.usage, response.choices[0].finish_reason)
        except openai.OpenAIError as exc:
            raise BackendError(f"{self.base_url}: {exc}") from exc
        if (meta["finish_reason"] or {}).get("type") != "length":
            _check_constraint(text, body.get("regex"), self.base_url)
        return GenOutput(text, meta)

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        if prompt.uses_roles:
            raise BackendError(
                "fl.OpenAI cannot select inside a chat program: scoring choices needs prompt "
                "logprobs, which the OpenAI chat API does not return. Use "
                "fl.gen(name, choices=[...]) (constrained decoding, where the server supports "
                "it) or the Engine / RuntimeEndpoint backend."
            )
        rows = self._prompt_logprobs([prompt.text] + [prompt.text + c for c in choices])
        prefix_tokens, _ = rows[0]
        return ChoiceLogprobs(
            prefix_tokens=list(prefix_tokens),
            choice_tokens=[list(tokens) for tokens, _ in rows[1:]],
            choice_logprobs=[logprobs for _, logprobs in rows[1:]],
            meta=[{} for _ in choices],
        )

    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        return [logprobs for _, logprobs in self._prompt_logprobs(list(choices))]

    def _prompt_logprobs(self, texts: list[str]) -> list[tuple[list[Hashable], list[float]]]:
        """Per text: its prompt tokens (as strings) from the first one with a logprob (after
        BOS), and their logprobs. ``max_tokens=0`` with ``echo``: the prompt alone, scored."""
        why = (
            "fl.OpenAI: select needs prompt logprobs (/v1/completions with echo=true, "
            f"logprobs and max_tokens=0), and {self.base_url} did not return them"
        )
        try:
            with self._clients.lease() as client:
                response = client.completions.create(
                    model=self.model, prompt=texts, max_tokens=0, temperature=0, echo=True,
                    logprobs=0,
                )  # fmt: skip
        except openai.OpenAIError as exc:
            raise BackendError(f"{why}: {exc}") from exc
        rows: list[tuple[list[Hashable], list[float]] | None] = [None] * len(texts)
        for choice in response.choices:
            logprobs = choice.logprobs
            if logprobs is None or not logprobs.tokens or not logprobs.token_logprobs:
                raise BackendError(f"{why}: the answer has no logprobs")
            pairs = list(zip(logprobs.tokens, logprobs.token_logprobs, strict=True))
            while pairs and pairs[0][1] is None:  # BOS, or the first token: nothing predicts it
                pairs.pop(0)
            if any(lp is None for _, lp in pairs):
                raise BackendError(f"{why}: some prompt tokens have no logprob")
            rows[choice.index] = ([t for t, _ in pairs], [float(lp) for _, lp in pairs])
        if any(row is None for row in rows):
            raise BackendError(f"{why}: the answer has {len(response.choices)} of {len(texts)}")
        return rows  # type: ignore[return-value]


def _check_chat_turn(prompt: Prompt) -> None:
    if prompt.open_role != "assistant" or prompt.open_content:
        raise BackendError(
            "fl.OpenAI sends a chat program as messages, so a gen must open an assistant turn: "
            "s += fl.assistant(fl.gen(...)), or `with s.assistant(): s += fl.gen(...)` first"
        )


def _response_format(schema: dict[str, Any] | str) -> dict[str, Any]:
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": parsed}}


def _collect_stream(chunks: Any, on_delta: Callable[[str], None]) -> tuple[str, dict[str, Any]]:
    text, usage, finish = "", None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            if piece:
                on_delta(piece)
                text += piece
            finish = choice.finish_reason or finish
    return text, _meta(usage, finish)


def _meta(usage: Any, finish_reason: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": {"type": finish_reason} if finish_reason else None}
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["completion_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        meta["cached_tokens"] = getattr(details, "cached_tokens", None) or 0
    return meta


def _check_constraint(text: str, regex: str | None, url: str) -> None:
    """A server that ignores ``regex`` (or choices) answers unconstrained text: refuse it."""
    if regex is not None and re.fullmatch(regex, text) is None:
        raise BackendError(f"{url} ignored the regex constraint: it answered {text!r}")
