"""One engine replica of ``arbor serve --dp N``, the body of a Ray actor.

A replica is what the three-process server runs behind its HTTP front, minus the front: the
scheduler (model, KV pool, radix cache) and the detokenizer, here on two threads of the actor's
process as in the in-process Engine. It reads tokenized requests from a ZMQ PULL socket bound
on a TCP port of its node and writes text outputs and control replies to the front's inbox, so
the front and its replicas may sit on different machines of a Ray cluster. The sockets carry
pickles: like Ray's own ports they belong on a trusted network.

The scheduler's two messages that speak for the whole server (ready, failed) are tagged with
the replica's index on the way out (``ReplicaReady``, ``ReplicaFailed``): one replica failing is
not the server failing. A replica whose scheduler crashes reports it, then exits its process,
so that Ray restarts the actor; the front takes it back once ``health`` says it serves again.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import zmq

from runtime.channels import QueueChannel, Sender, ZmqReceiver, ZmqSender
from runtime.components import Channels, build_components
from runtime.heap import freeze_startup_heap
from runtime.ipc import SchedulerFailed, SchedulerReady
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class ReplicaReady:
    replica: int
    incarnation: str
    info: dict[str, Any]


@dataclass
class ReplicaFailed:
    replica: int
    incarnation: str
    error: str


class _Tagged:
    """The sender to the front, with the scheduler's server-wide messages made per replica."""

    def __init__(self, inner: Sender, replica: int, incarnation: str) -> None:
        self.inner, self.replica, self.incarnation = inner, replica, incarnation

    def send(self, message: Any) -> None:
        if isinstance(message, SchedulerReady):
            message = ReplicaReady(self.replica, self.incarnation, message.info)
        elif isinstance(message, SchedulerFailed):
            message = ReplicaFailed(self.replica, self.incarnation, message.error)
        self.inner.send(message)


def node_address() -> str:
    """An address of this machine the others can reach (Ray's view of it when Ray runs)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - Ray is a dependency
        pass
    return socket.gethostbyname(socket.gethostname())


class Replica:
    """Scheduler + detokenizer serving the front at ``front_address`` (a ``tcp://`` PULL)."""

    def __init__(self, args: ServerArgs, replica: int, front_address: str, threads: int) -> None:
        logging.basicConfig(
            level=args.log_level.upper(),
            format=f"%(asctime)s [replica {replica} {os.getpid()}] %(levelname)s %(name)s: "
            "%(message)s",
        )
        import torch

        torch.set_num_threads(max(1, threads))
        self.replica = replica
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._context = zmq.Context()
        self._inbox = ZmqReceiver.bind_tcp(self._context, node_address())
        self.address = self._inbox.address
        to_front = _Tagged(
            ZmqSender(self._context, front_address, bind=False), replica, self.incarnation
        )
        to_detokenizer = QueueChannel()
        parts = build_components(
            args,
            Channels(self._inbox, to_detokenizer, None, None, to_detokenizer, to_front),
            replica,
        )
        assert parts.scheduler is not None
        self._scheduler = parts.scheduler
        self._failed: str | None = None
        self._threads = parts.start_threads(self._run_scheduler)
        freeze_startup_heap(f"replica {replica}", args)
        logger.info("replica %d serving at %s", replica, self.address)

    def _run_scheduler(self) -> None:
        try:
            self._scheduler.event_loop()
        except Exception as exc:  # reported to the front as ReplicaFailed by the loop
            self._failed = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)  # let the report leave
            os._exit(1)  # Ray restarts the actor

    def health(self) -> dict[str, Any]:
        """What the front polls: serving or not, where, and which incarnation."""
        alive = self._failed is None and all(t.is_alive() for t in self._threads)
        return {
            "ok": alive,
            "error": self._failed,
            "address": self.address,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node": node_address(),
        }

    def stop(self) -> bool:
        self._scheduler.stop()
        self._threads[0].join(10.0)
        return True
