"""``fl.Engine``: the DSL on an in-process ``runtime.Engine``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from frontend_lang.backends.base import BackendError
from frontend_lang.backends.native import NativeBackend, template_or_error
from frontend_lang.chat import ChatTemplate
from runtime import dsl_api


class Engine(NativeBackend):
    """Runs the model in this process: ``fl.Engine(model_path, max_total_tokens=8192, ...)``
    takes any ``runtime.ServerArgs`` field. Shut it down (or use it as a context manager) to
    stop the runtime's threads. ``engine`` is the wrapped ``runtime.Engine``. ``cache_salt``:
    the programs run on it share cached KV only with requests of the same salt."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        chat_template: ChatTemplate | None = None,
        cache_salt: str | None = None,
        **server_args: Any,
    ) -> None:
        super().__init__(chat_template, cache_salt)
        self.engine = dsl_api.Engine(model_path, **server_args)

    def _call(self, payload: dict[str, Any]) -> Any:
        try:
            return self.engine.generate(**_engine_kwargs(self._salted(payload)))
        except (ValueError, dsl_api.SchedulerDied) as exc:
            raise BackendError(str(exc)) from exc

    def _stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            yield from self.engine.generate(**_engine_kwargs(self._salted(payload)), stream=True)
        except (ValueError, dsl_api.SchedulerDied) as exc:
            raise BackendError(str(exc)) from exc

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            yield from self.engine.run_program(self._salted(request))
        except (ValueError, dsl_api.SchedulerDied) as exc:
            raise BackendError(str(exc)) from exc

    def end_program(self, program_id: str) -> None:
        self.engine.end_program(program_id, self.cache_salt)

    def _prompt_tokens(self, text: str) -> int:
        # The engine's own tokenizer, in this process: no round trip. The scoring batch then
        # prefills the prefix once (requests of one step share what they have in common).
        return len(self.engine.tokenizer(text).input_ids)

    def _load_chat_template(self) -> ChatTemplate:
        def load() -> ChatTemplate:
            role_blocks = getattr(self.engine, "role_blocks", None)
            if role_blocks is None:  # an engine-like object with a tokenizer only
                return ChatTemplate.from_tokenizer(self.engine.tokenizer)
            blocks = role_blocks()  # derived once per runtime engine
            return ChatTemplate(blocks.begin, blocks.prefix, blocks.suffix)

        return template_or_error(load)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _engine_kwargs(payload: dict[str, Any]) -> dict[str, Any]:
    """Native request fields as ``runtime.Engine.generate`` keywords (``text`` is ``prompt``)."""
    kwargs = dict(payload)
    kwargs["prompt"] = kwargs.pop("text")
    return kwargs
