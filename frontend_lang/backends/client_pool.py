"""HTTP clients for the HTTP backends, each used by one thread at a time.

``run_batch`` and forks call a backend from many threads. An httpx client's connection pool
shared between threads occasionally hands a thread a connection another thread has just closed
(measured against ``arbor serve``: ReadError "[Errno 9] Bad file descriptor" about once per
10,000 calls from 96 threads). So a call leases a whole client for its duration (a stream's
included) and gives it back for the next call, from any thread: no client is used by two
threads at once, and short-lived threads (a fork's branches) reuse warm clients and their
kept-alive connections instead of making new ones. The clients share one TLS context
(``shared_ssl_context``): making it is most of a client's cost (~15 ms: it loads the CA
bundle), the rest ~0.1 ms.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Generic, TypeVar

import httpx

Client = TypeVar("Client")


class ClientPool(Generic[Client]):
    def __init__(self, make: Callable[[], Client], close: Callable[[Client], None]) -> None:
        self._make, self._close = make, close
        self._free: list[Client] = []
        self._made = 0
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def lease(self) -> Iterator[Client]:
        """A client for this call alone; made when none is free."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the backend was shut down")
            client = self._free.pop() if self._free else None
        if client is None:
            client = self._make()
            with self._lock:
                self._made += 1
        try:
            yield client
        finally:
            with self._lock:
                keep = not self._closed
                if keep:
                    self._free.append(client)
            if not keep:
                self._close(client)

    @property
    def size(self) -> int:
        """Clients made so far (at most the number of calls ever in flight at once)."""
        return self._made

    def close_all(self) -> None:
        """Close every client; one leased now closes when its call ends."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for client in free:
            self._close(client)


@cache
def shared_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CA bundle, SSL_CERT_FILE honoured), made once for
    every HTTP backend's clients."""
    return httpx.create_ssl_context()
