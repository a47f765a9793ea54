"""The DSL over Arbor's native generate API, shared by the in-process Engine and the HTTP
RuntimeEndpoint: both take the same request fields and answer with the same result dicts
(``{"text", "output_ids", "meta_info": {...}}``), so only the transport differs."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from frontend_lang.backends.base import (
    HEAL_WINDOW,
    Backend,
    ChoiceLogprobs,
    GenOutput,
    OnDelta,
    Prompt,
)
from frontend_lang.chat import ChatTemplate, ChatTemplateError
from runtime.dsl_api import check_cache_salt

SCORE_ONLY = {"max_new_tokens": 0}


class NativeBackend(Backend):
    """A backend speaking the native API. Subclasses provide the transport: ``_call`` for one
    request (a batch when ``text`` is a list) and ``_stream`` for a streamed one; both raise
    BackendError with the runtime's message. Each transport sends its payloads through
    ``_salted``, so that every request and program segment carries ``cache_salt``: the
    program's calls share cached KV only with requests of the same salt."""

    def __init__(self, chat_template: ChatTemplate | None, cache_salt: str | None = None) -> None:
        check_cache_salt(cache_salt)  # a bad salt fails here, not at the program's first call
        self.cache_salt = cache_salt
        self._chat_template = chat_template
        # run_batch's threads all reach for the template at once: one of them loads it.
        self._template_lock = threading.Lock()

    def _salted(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with this backend's cache salt, if it has one."""
        return payload if self.cache_salt is None else {**payload, "cache_salt": self.cache_salt}

    @abstractmethod
    def _call(self, payload: dict[str, Any]) -> Any:
        """One native request; the result dict (a list of them for a batch)."""

    @abstractmethod
    def _stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """One streamed native request: result dicts whose ``text`` is cumulative."""

    @abstractmethod
    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """One segment of a compiled program: the runtime's events (``runtime/program``)."""

    @property
    def supports_programs(self) -> bool:
        return True

    @abstractmethod
    def _load_chat_template(self) -> ChatTemplate:
        """The model's template; raise ChatTemplateError when it cannot be had."""

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            with self._template_lock:
                if self._chat_template is None:
                    self._chat_template = self._load_chat_template()
        return self._chat_template

    def generate(
        self, prompt: Prompt, sampling_params: dict[str, Any], on_delta: OnDelta | None = None
    ) -> GenOutput:
        payload = {"text": prompt.text, "sampling_params": sampling_params}
        if on_delta is None:
            result = self._call(payload)
            return GenOutput(result["text"], _interpreted(result["meta_info"]))
        text, meta = "", {}
        for chunk in self._stream(payload):
            new_text = chunk["text"]
            if len(new_text) > len(text) and new_text.startswith(text):
                on_delta(new_text[len(text) :])
                text = new_text
            meta = chunk["meta_info"]
        return GenOutput(text, _interpreted(meta))

    def choice_logprobs(self, prompt: Prompt, choices: list[str]) -> ChoiceLogprobs:
        """The prefix's token count (a call that also caches it, unless the backend can count
        locally), then the prefix and every prefix + choice in one batch, scored from
        HEAL_WINDOW tokens before the prefix's end. The batch's prompt logprobs start there, so
        the cache serves everything before."""
        prefix = prompt.text
        prefix_len = self._prompt_tokens(prefix) if prefix else 1
        start = max(1, prefix_len - HEAL_WINDOW)
        with_prefix = prefix_len > start
        texts = ([prefix] if with_prefix else []) + [prefix + c for c in choices]
        results = self._call(
            {
                "text": texts,
                "sampling_params": SCORE_ONLY,
                "return_logprob": True,
                "logprob_start_len": start,
            }
        )
        entries = [r["meta_info"]["input_token_logprobs"] for r in results]
        prefix_entries = entries.pop(0) if with_prefix else []
        return ChoiceLogprobs(
            prefix_tokens=[e[1] for e in prefix_entries],
            choice_tokens=[[e[1] for e in row] for row in entries],
            choice_logprobs=[[e[0] for e in row] for row in entries],
            meta=[_score_meta(r["meta_info"]) for r in results[int(with_prefix) :]],
        )

    def _prompt_tokens(self, text: str) -> int:
        """How many tokens the runtime makes of ``text``; asking also caches its prefill."""
        primed = self._call({"text": text, "sampling_params": SCORE_ONLY})
        return int(primed["meta_info"]["prompt_tokens"])

    def unconditional_logprobs(self, choices: list[str]) -> list[list[float]]:
        results = self._call(
            {
                "text": list(choices),
                "sampling_params": SCORE_ONLY,
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        )
        return [
            [e[0] for e in r["meta_info"]["input_token_logprobs"] if e[0] is not None]
            for r in results
        ]

    def cache_prefix(self, prompt: Prompt) -> None:
        if prompt.text:
            self._call({"text": prompt.text, "sampling_params": SCORE_ONLY})


def _interpreted(meta: dict[str, Any]) -> dict[str, Any]:
    """An interpreted call sends the whole text: every prompt token is encoded again."""
    meta = dict(meta)
    meta.setdefault("reused_tokens", 0)
    meta.setdefault("reencoded_tokens", int(meta.get("prompt_tokens") or 0))
    return meta


def _score_meta(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("prompt_tokens", "cached_tokens") if k in meta}


def template_or_error(load: Callable[[], ChatTemplate]) -> ChatTemplate:
    """``load()``, with ChatTemplateError's message telling the user how to go on."""
    try:
        return load()
    except ChatTemplateError as exc:
        raise ChatTemplateError(
            f"{exc}; role blocks need a chat template: pass chat_template=fl.CHATML "
            "(or another fl.ChatTemplate) to the backend"
        ) from None
