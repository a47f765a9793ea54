"""Transports for the messages in ``runtime.ipc``: in-process queues or ZMQ PUSH/PULL sockets.

The scheduler, detokenizer and tokenizer manager only see ``send`` and ``recv``; the Engine
connects them with queues inside one process, ``arbor serve`` with ZMQ between processes.
"""

from __future__ import annotations

import queue
from typing import Any, Protocol

import zmq

import runtime.ipc as ipc


class Sender(Protocol):
    def send(self, message: Any) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout: float | None) -> Any | None:
        """The next message; waits up to ``timeout`` seconds (None: forever), None on timeout."""
        ...


class QueueChannel:
    """Both ends of an in-process channel."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()

    def send(self, message: Any) -> None:
        self._queue.put(message)

    def recv(self, timeout: float | None) -> Any | None:
        try:
            return self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None


class ZmqSender:
    def __init__(self, context: zmq.Context, address: str, bind: bool) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        (self._socket.bind if bind else self._socket.connect)(address)

    def send(self, message: Any) -> None:
        self._socket.send(ipc.encode(message))

    def close(self) -> None:
        self._socket.close(linger=0)


class ZmqReceiver:
    def __init__(self, context: zmq.Context, address: str, bind: bool) -> None:
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.address = address
        if address.endswith(":*"):  # a TCP port the system picks
            port = self._socket.bind_to_random_port(address[:-2])
            self.address = f"{address[:-2]}:{port}"
        else:
            (self._socket.bind if bind else self._socket.connect)(address)

    @classmethod
    def bind_tcp(cls, context: zmq.Context, host: str) -> ZmqReceiver:
        """Bound on a free TCP port of ``host``; ``address`` tells the port."""
        return cls(context, f"tcp://{host}:*", bind=True)

    def recv(self, timeout: float | None) -> Any | None:
        if timeout is None or self._socket.poll(int(timeout * 1000)):
            return ipc.decode(self._socket.recv())
        return None

    def close(self) -> None:
        self._socket.close(linger=0)


def drain(receiver: Receiver, timeout: float | None) -> list[Any]:
    """Wait up to ``timeout`` for a first message, then take every message already queued."""
    first = receiver.recv(timeout)
    if first is None:
        return []
    messages = [first]
    while (more := receiver.recv(0)) is not None:
        messages.append(more)
    return messages
