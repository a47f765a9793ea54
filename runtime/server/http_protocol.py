"""How every Arbor server runs uvicorn: its config, the signals that stop it, and an h11
protocol with a deadline on every request head (slow-header clients).

uvicorn bounds idle keep-alive connections but not a client that trickles its request line and
headers a byte at a time: each byte restarts nothing, and the connection stays open for good,
so a few thousand such clients exhaust ``--max-connections``. Here each connection must finish
each request head within ``header_timeout`` seconds of starting it (of connecting, or of the
previous response), or it is closed. Bodies have their own deadline (``read_json``).
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.server_args import ServerArgs

GRACEFUL_SHUTDOWN_S = 5
# Longest request head (request line and headers) a client may send.
MAX_HEADER_BYTES = 64 * 1024


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by ``with_header_timeout``

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_overdue)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for a server whose request heads must arrive within ``seconds``."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": seconds})


def uvicorn_config(app: Any, args: ServerArgs) -> uvicorn.Config:
    """How every Arbor server runs uvicorn: its limits and timeouts from ``args``."""
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=args.timeout_keep_alive_s,
        limit_concurrency=args.max_connections,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        http=with_header_timeout(args.header_timeout_s),
    )


class StopSignal:
    """Records SIGINT/SIGTERM. uvicorn installs its own handlers while it serves and, after
    its graceful shutdown, restores these and re-raises the signal it got: recording it here
    (instead of the default action) lets the children and the socket files be cleaned up."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.server: uvicorn.Server | None = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        if self.server is not None:
            self.server.should_exit = True


def bound_port(server: uvicorn.Server, asked: int) -> int:
    """The port ``server`` listens on: the one the OS chose for ``--port 0``."""
    for listener in getattr(server, "servers", None) or []:
        for sock in getattr(listener, "sockets", None) or []:
            name = sock.getsockname()
            if isinstance(name, tuple) and len(name) >= 2:
                return int(name[1])
    return asked
