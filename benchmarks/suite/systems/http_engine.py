"""A running ``arbor serve`` behind the ``runtime.Engine`` calls the workloads make.

The workloads drive an Engine (``generate``, ``async_generate``, ``get_server_info``,
``flush_cache``, ``tokenizer``); ``HttpEngine`` makes the same calls over the native HTTP API, so
the same workloads measure a server — a routed ``--dp N`` one in ``benchmarks/dp_bench.py``.
Streams are the native API's server-sent events, one chunk dict per event, as the Engine's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from frontend_lang.backends.client_pool import ClientPool, shared_ssl_context
from runtime.model_files import load_tokenizer

TIMEOUT = httpx.Timeout(600.0, connect=30.0)


class HttpEngine:
    def __init__(self, url: str, model_path: str) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = load_tokenizer(model_path)
        # One httpx.Client per concurrent call: the workloads call from many threads at once
        # (run_batch), and one shared sync client failed reads with EBADF under that load. The
        # clients share one TLS context: making one per client cost ~25 ms of CPU each, seconds
        # in a run that opens a hundred.
        self._clients = ClientPool(
            lambda: httpx.Client(timeout=TIMEOUT, verify=shared_ssl_context()), httpx.Client.close
        )
        self._async: httpx.AsyncClient | None = None

    def close(self) -> None:
        self._clients.close_all()

    @staticmethod
    def _payload(prompt: Any, kwargs: dict[str, Any], stream: bool) -> dict[str, Any]:
        payload = {k: v for k, v in kwargs.items() if v is not None}
        if prompt is not None:
            payload["text"] = prompt
        payload["stream"] = stream
        return payload

    def generate(self, prompt: Any = None, stream: bool = False, **kwargs: Any) -> Any:
        payload = self._payload(prompt, kwargs, stream)
        if stream:
            return self._stream(payload)
        with self._clients.lease() as client:
            response = client.post(f"{self.url}/generate", json=payload)
        _check(response)
        return response.json()

    def _stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with (
            self._clients.lease() as client,
            client.stream("POST", f"{self.url}/generate", json=payload) as response,
        ):
            _check(response)
            for line in response.iter_lines():
                chunk = _event(line)
                if chunk is not None:
                    yield chunk

    async def async_generate(self, prompt: Any = None, stream: bool = False, **kwargs: Any) -> Any:
        payload = self._payload(prompt, kwargs, stream)
        if self._async is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            self._async = httpx.AsyncClient(timeout=TIMEOUT, limits=limits)
        if stream:
            return self._astream(self._async, payload)
        response = await self._async.post(f"{self.url}/generate", json=payload)
        _check(response)
        return response.json()

    async def _astream(
        self, client: httpx.AsyncClient, payload: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        async with client.stream("POST", f"{self.url}/generate", json=payload) as response:
            _check(response)
            async for line in response.aiter_lines():
                chunk = _event(line)
                if chunk is not None:
                    yield chunk

    def get_server_info(self) -> dict[str, Any]:
        with self._clients.lease() as client:
            response = client.get(f"{self.url}/get_server_info")
        _check(response)
        return response.json()

    def flush_cache(self) -> bool:
        with self._clients.lease() as client:
            return client.post(f"{self.url}/flush_cache").status_code == 200

    def reset_async(self) -> None:
        """Forget the async client (each ``asyncio.run`` of a workload has its own loop)."""
        self._async = None


def _event(line: str) -> dict[str, Any] | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk = json.loads(line[len("data: ") :])
    if "error" in chunk:
        raise RuntimeError(f"the server failed a request: {chunk['error']}")
    return chunk


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        response.read()
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")
