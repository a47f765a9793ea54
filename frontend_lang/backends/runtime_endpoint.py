"""``fl.RuntimeEndpoint``: the DSL over HTTP against ``arbor serve``'s native ``/generate``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from frontend_lang.backends.base import BackendError, ProgramsUnsupported
from frontend_lang.backends.client_pool import ClientPool, shared_ssl_context
from frontend_lang.backends.native import NativeBackend, template_or_error
from frontend_lang.chat import ChatTemplate, ChatTemplateError


class RuntimeEndpoint(NativeBackend):
    """A running ``arbor serve`` (or any server with SGLang's native API) at ``url``.

    Requests carry ``Authorization: Bearer <api_key>`` when a key is given, and ``cache_salt``
    when one is given (they then share cached KV only with requests of the same salt). Role
    blocks are rendered with ``chat_template`` if given, else with the role blocks ``arbor
    serve`` reports in ``/get_model_info``; against a server that reports none (SGLang's), with
    the template of the tokenizer it names there, which must then be a folder on this
    machine."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate | None = None,
        timeout_s: float = 600.0,
        cache_salt: str | None = None,
    ) -> None:
        super().__init__(chat_template, cache_salt)
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._clients = ClientPool(
            lambda: httpx.Client(
                base_url=self.url, headers=headers, timeout=timeout, verify=shared_ssl_context()
            ),
            httpx.Client.close,
        )

    def _call(self, payload: dict[str, Any]) -> Any:
        try:
            with self._clients.lease() as client:
                response = client.post("/generate", json=self._salted(payload))
        except httpx.HTTPError as exc:
            raise BackendError(f"{self.url}/generate: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise BackendError(_error_message(self.url, response.status_code, response.text))
        return response.json()

    def _stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._sse("/generate", {**self._salted(payload), "stream": True})

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``POST /program``, streamed. A server without it (404/405) raises
        ProgramsUnsupported, and the program goes on interpreted."""
        yield from self._sse("/program", {**self._salted(request), "stream": True}, programs=True)

    def _sse(
        self, path: str, body: dict[str, Any], programs: bool = False
    ) -> Iterator[dict[str, Any]]:
        """The JSON events of a streamed POST (up to ``data: [DONE]``); an error event or
        status raises BackendError with the server's message."""
        try:
            with self._clients.lease() as client, client.stream("POST", path, json=body) as resp:
                if programs and resp.status_code in (404, 405):
                    raise ProgramsUnsupported(f"{self.url} has no {path} endpoint")
                if resp.status_code >= 400:
                    text = resp.read().decode(errors="replace")
                    raise BackendError(_error_message(self.url, resp.status_code, text))
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    # (program events of type "error" are one branch's, handled by the caller)
                    if "error" in event and "type" not in event:
                        raise BackendError(_error_message(self.url, 500, data))
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc

    def end_program(self, program_id: str) -> None:
        try:
            with self._clients.lease() as client:
                client.delete(f"/program/{program_id}", params=self._salted({}))
        except httpx.HTTPError:
            pass  # the server drops idle programs itself

    def _load_chat_template(self) -> ChatTemplate:
        def load() -> ChatTemplate:
            info = self.get_model_info()
            blocks = info.get("chat_template_blocks")
            if isinstance(blocks, dict):  # arbor serve derives them from its own tokenizer
                return ChatTemplate(blocks["begin"], blocks["prefix"], blocks["suffix"])
            if "chat_template_error" in info:
                raise ChatTemplateError(
                    f"the server's chat template: {info['chat_template_error']}"
                )
            # Other servers with SGLang's native API: the tokenizer's folder, read here.
            from transformers import AutoTokenizer

            path = info.get("tokenizer_path") or info.get("model_path")
            if not path or not Path(path).is_dir():
                raise ChatTemplateError(
                    f"the server's tokenizer {path!r} is not a folder on this machine"
                )
            return ChatTemplate.from_tokenizer(AutoTokenizer.from_pretrained(path))

        return template_or_error(load)

    def get_model_info(self) -> dict[str, Any]:
        with self._clients.lease() as client:
            response = client.get("/get_model_info")
        if response.status_code >= 400:
            raise BackendError(_error_message(self.url, response.status_code, response.text))
        return response.json()

    def shutdown(self) -> None:
        self._clients.close_all()


def _error_message(url: str, status: int, body: str) -> str:
    """The server's own message where the body carries one (``{"error": {"message"}}``,
    ``{"error": "..."}`` or FastAPI's ``{"detail": ...}``), else the raw body."""
    message: Any = body
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed.get("detail", body))
        message = error.get("message", error) if isinstance(error, dict) else error
    return f"{url} answered {status}: {message}"
