"""``arbor serve``: three processes connected by ZMQ over ``ipc://`` sockets.

    server process (this one)        scheduler process            detokenizer process
    FastAPI on uvicorn (uvloop)  --> Scheduler.event_loop  -->   DetokenizerManager
    + TokenizerManager           <-- (ready/failed/control)      .event_loop
                                 <------------------------------ (text outputs)

The socket files live in a fresh temporary directory, removed on exit. The server process
watches its children: if either exits, or the scheduler reports a crash, every pending
request fails with 503 and the server exits with status 1 within about a second. SIGINT or
SIGTERM stop uvicorn (in-flight requests get a few seconds), then the children, and the
process exits with status 0.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
import zmq

from runtime.channels import ZmqReceiver, ZmqSender
from runtime.components import Channels, build_components
from runtime.heap import freeze_startup_heap
from runtime.heartbeat import Heartbeat
from runtime.model_config import ModelConfig
from runtime.model_files import locate_model
from runtime.server.http_app import create_app
from runtime.server.http_protocol import StopSignal, bound_port, uvicorn_config
from runtime.server.processes import IpcAddresses, run_detokenizer_process, run_scheduler_process
from runtime.server.state import ServerState
from runtime.server.warm_up import WarmUp
from runtime.server_args import ServerArgs
from runtime.startup_phases import StartupPhases, log_startup

logger = logging.getLogger(__name__)

CHILD_STOP_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 0.2


def launch_server(args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until a child process dies or the scheduler
    fails (returns 1). Blocks; call from the main thread (it installs signal handlers). A
    model that cannot be loaded raises ModelLoadError before any process starts."""
    launched = time.perf_counter()
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s [{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    phases = StartupPhases()
    with phases.phase("model files"):
        check_model_files(args)
    if args.dp_size > 1:
        from runtime.server.dp_launcher import launch_routed_server

        return launch_routed_server(args)
    stop = StopSignal()
    ipc_dir = Path(tempfile.mkdtemp(prefix="arbor-ipc-"))
    addresses = IpcAddresses.in_dir(ipc_dir)
    context = zmq.Context()
    inbox = ZmqReceiver(context, addresses.tokenizer, bind=True)
    to_scheduler = ZmqSender(context, addresses.scheduler, bind=False)
    children: dict[str, BaseProcess] = {}
    heartbeat = Heartbeat.shared()
    try:
        children = _start_children(args, addresses, heartbeat)
        phases.lap("start processes")
        parts = build_components(args, Channels(tokenizer_inbox=inbox, to_scheduler=to_scheduler))
        assert parts.tokenizer_manager is not None
        state = ServerState(
            args,
            parts.tokenizer,
            parts.tokenizer_manager,
            process_info={
                "server_pid": os.getpid(),
                "scheduler_pid": children["scheduler"].pid,
                "detokenizer_pid": children["detokenizer"].pid,
                "ipc_dir": str(ipc_dir),
            },
            scheduler_heartbeat=heartbeat,
        )
        phases.lap("tokenizer manager")
        if stop.signum is not None:
            return 0
        supervisor = _Supervisor(state, children, stop, phases, launched)
        return uvloop.run(supervisor.serve(inbox, addresses, context))
    finally:
        _stop_children(children)
        inbox.close()
        to_scheduler.close()
        context.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def check_model_files(args: ServerArgs) -> None:
    """Name what is wrong with the model's (and the draft model's) files before a process
    starts; a GGUF file's config and tokenizer are converted here, once, for all of them."""
    ModelConfig.from_pretrained(args.model_path)
    if args.tokenizer_path:
        locate_model(args.tokenizer_path)
    if args.speculative_draft_model_path:
        ModelConfig.from_pretrained(args.speculative_draft_model_path)


@dataclass
class _Supervisor:
    """Runs uvicorn and, beside it, the watch over the child processes and the warm-up
    (``runtime.server.warm_up``) once the scheduler is ready."""

    state: ServerState
    children: dict[str, BaseProcess]
    stop: StopSignal
    phases: StartupPhases  # the server process's, so far
    launched: float  # perf_counter() at launch_server's start
    exit_code: int = 0
    warm_up: WarmUp = field(default_factory=WarmUp)

    async def serve(
        self, inbox: ZmqReceiver, addresses: IpcAddresses, context: zmq.Context[Any]
    ) -> int:
        args = self.state.args
        receiver = self.state.tokenizer_manager.start_receiver(inbox, asyncio.get_running_loop())
        app = create_app(self.state)
        app.state.warm_up = self.warm_up  # /health says ready once it is done
        server = uvicorn.Server(uvicorn_config(app, args))
        self.stop.server = server
        watch = asyncio.create_task(self._watch(server))
        try:
            await server.serve()
        finally:
            watch.cancel()
            # A None message ends the receiver thread, which owns ``inbox`` until then.
            stopper = ZmqSender(context, addresses.tokenizer, bind=False)
            stopper.send(None)
            await asyncio.to_thread(receiver.join, 5.0)
            stopper.close()
            self.state.close()
        return self.exit_code

    async def _watch(self, server: uvicorn.Server) -> None:
        manager = self.state.tokenizer_manager
        warming: asyncio.Task[None] | None = None
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name, process in self.children.items():
                if process.exitcode is not None:
                    self._fail(server, f"the {name} process exited with code {process.exitcode}")
                    return
            if manager.dead:
                self._fail(server, f"the scheduler failed: {manager.dead}")
                return
            if warming is None and manager.ready.is_set():
                self.phases.lap("scheduler start")
                announce = functools.partial(self._announce, server)
                warming = asyncio.create_task(self.warm_up.run(self.state, announce))

    def _announce(self, server: uvicorn.Server) -> None:
        """Once warmed up, before /health says ready: one line per startup phase (the
        scheduler's, the server process's, the warm-up's), then the ready line."""
        args = self.state.args
        freeze_startup_heap("server process", args)
        scheduler = self.state.tokenizer_manager.server_info.get("startup_phases") or []
        phases = [(f"scheduler: {name}", seconds) for name, seconds in scheduler]
        phases += [(f"server: {name}", seconds) for name, seconds in self.phases.phases]
        phases += self.warm_up.phases.phases
        log_startup(logger, phases, time.perf_counter() - self.launched)
        port = bound_port(server, args.port)
        logger.info("ready: %s at http://%s:%d", args.model_name, args.host, port)

    def _fail(self, server: uvicorn.Server, message: str) -> None:
        logger.error("%s; shutting down", message)
        self.exit_code = 1
        if not self.state.tokenizer_manager.dead:
            self.state.tokenizer_manager.fail_all(message)
        server.should_exit = True


def _start_children(
    args: ServerArgs, addresses: IpcAddresses, heartbeat: Heartbeat
) -> dict[str, BaseProcess]:
    spawn = multiprocessing.get_context("spawn")  # fork after importing torch is unsafe
    children: dict[str, BaseProcess] = {}
    common = (args, addresses, os.getpid())
    for name, target, target_args in (
        ("scheduler", run_scheduler_process, (*common, heartbeat)),
        ("detokenizer", run_detokenizer_process, common),
    ):
        process = spawn.Process(target=target, args=target_args, name=f"arbor-{name}")
        process.start()
        children[name] = process
    return children


def _stop_children(children: dict[str, BaseProcess]) -> None:
    """SIGTERM each child, then SIGKILL whichever has not exited in time."""
    for process in children.values():
        if process.is_alive():
            process.terminate()
    for process in children.values():
        process.join(CHILD_STOP_TIMEOUT_S)
        if process.is_alive():
            logger.warning("%s did not stop; killing it", process.name)
            process.kill()
            process.join(1.0)
