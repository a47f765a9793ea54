"""One HTTP client per thread for the HTTP backends.

``run_batch`` calls a backend from many threads, and an httpx client's connection pool shared
between threads occasionally hands a thread a connection another thread has just closed
(measured against ``arbor serve``: ReadError "[Errno 9] Bad file descriptor" about once per
10,000 calls from 96 threads; none with a client per thread). Each thread gets its own client,
closed when the thread ends or at ``close_all``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

Client = TypeVar("Client")


class PerThread(Generic[Client]):
    def __init__(self, make: Callable[[], Client], close: Callable[[Client], None]) -> None:
        self._make, self._close = make, close
        self._local = threading.local()
        self._live: weakref.WeakSet[_Owned[Client]] = weakref.WeakSet()
        self._lock = threading.Lock()

    def get(self) -> Client:
        """This thread's client, made on first use."""
        owned: _Owned[Client] | None = getattr(self._local, "owned", None)
        if owned is None:
            owned = _Owned(self._make(), self._close)
            self._local.owned = owned
            with self._lock:
                self._live.add(owned)
        return owned.client

    def close_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for owned in live:
            owned.close()


class _Owned(Generic[Client]):
    """A thread's client: closed when the thread's locals go (its thread ended)."""

    def __init__(self, client: Client, close: Callable[[Client], None]) -> None:
        self.client, self._close, self._closed = client, close, False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close(self.client)

    def __del__(self) -> None:
        self.close()
