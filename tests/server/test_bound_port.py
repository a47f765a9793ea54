"""The "ready" log line names the port the server listens on, also for ``--port 0``."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any, cast

from runtime.server.http_protocol import bound_port


def test_bound_port_reads_the_listening_socket():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        chosen = sock.getsockname()[1]
        server = SimpleNamespace(servers=[SimpleNamespace(sockets=[sock])])
        assert bound_port(cast(Any, server), 0) == chosen


def test_bound_port_falls_back_to_the_asked_port_before_listening():
    assert bound_port(cast(Any, SimpleNamespace(servers=[])), 8000) == 8000
    assert bound_port(cast(Any, SimpleNamespace()), 8000) == 8000
