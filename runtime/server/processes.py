"""The two child processes of ``arbor serve``: the scheduler and the detokenizer.

Each is started with multiprocessing's "spawn" method (forking a process that has imported
torch is unsafe), binds the ZMQ socket it reads from, connects to the ones it writes to, and
runs the same event loop the in-process Engine runs on a thread. A child ignores SIGINT (the
server process decides when to stop and sends SIGTERM) and exits on its own when the server
process is gone, so a killed server leaves no orphans.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from runtime.channels import ZmqReceiver, ZmqSender
from runtime.components import Channels, build_components
from runtime.errors import ModelLoadError
from runtime.heap import freeze_startup_heap
from runtime.heartbeat import Heartbeat
from runtime.ipc import SchedulerFailed
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IpcAddresses:
    """One ``ipc://`` PULL socket per reader: the scheduler's inbox, the detokenizer's inbox,
    and the tokenizer manager's inbox (written by both the scheduler and the detokenizer)."""

    scheduler: str
    detokenizer: str
    tokenizer: str

    @classmethod
    def in_dir(cls, directory: Path) -> IpcAddresses:
        return cls(
            scheduler=f"ipc://{directory / 'scheduler'}",
            detokenizer=f"ipc://{directory / 'detokenizer'}",
            tokenizer=f"ipc://{directory / 'tokenizer'}",
        )


def run_scheduler_process(
    args: ServerArgs, addresses: IpcAddresses, parent_pid: int, heartbeat: Heartbeat
) -> None:
    """Entry point of the scheduler process: load the model, then run the scheduler loop,
    which beats ``heartbeat`` (shared memory the server process reads for /health).

    A failure to start is reported to the tokenizer manager as SchedulerFailed, as a crash of
    the running loop is (by ``Scheduler.event_loop``); either way the process exits non-zero.
    """
    _prepare_child(args, parent_pid)
    context = zmq.Context()
    to_tokenizer = ZmqSender(context, addresses.tokenizer, bind=False)
    channels = Channels(
        scheduler_inbox=ZmqReceiver(context, addresses.scheduler, bind=True),
        to_detokenizer=ZmqSender(context, addresses.detokenizer, bind=False),
        to_tokenizer=to_tokenizer,
        scheduler_heartbeat=heartbeat,
    )
    try:
        scheduler = build_components(args, channels).scheduler
    except ModelLoadError as exc:  # the file's fault, said in one line: no traceback
        logger.error("%s", exc)
        to_tokenizer.send(SchedulerFailed(f"failed to load the model: {exc}"))
        time.sleep(0.2)
        sys.exit(1)
    except Exception as exc:
        logger.exception("the scheduler failed to start")
        to_tokenizer.send(SchedulerFailed(f"failed to start: {type(exc).__name__}: {exc}"))
        time.sleep(0.2)  # let the message leave before the process exits
        raise
    assert scheduler is not None
    signal.signal(signal.SIGTERM, lambda *_: scheduler.stop())
    scheduler.grammar.sandbox.prestart()  # a server's first constraint should not wait for it
    freeze_startup_heap("scheduler process", args)
    scheduler.event_loop()


def run_detokenizer_process(args: ServerArgs, addresses: IpcAddresses, parent_pid: int) -> None:
    """Entry point of the detokenizer process: token ids in, text out, until SIGTERM."""
    _prepare_child(args, parent_pid)
    context = zmq.Context()
    parts = build_components(
        args,
        Channels(
            detokenizer_inbox=ZmqReceiver(context, addresses.detokenizer, bind=True),
            to_tokenizer=ZmqSender(context, addresses.tokenizer, bind=False),
        ),
    )
    freeze_startup_heap("detokenizer process", args)
    parts.run_detokenizer()


def _prepare_child(args: ServerArgs, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    """Leave as soon as the server process is gone (SIGKILL gives it no chance to stop us)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
