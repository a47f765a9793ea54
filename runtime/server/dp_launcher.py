"""``arbor serve --dp N``: the HTTP front in this process, N replicas as Ray actors.

    this process                               Ray actors (this machine or a cluster)
    FastAPI + RoutedTokenizerManager  --tcp-->  Replica 0: Scheduler + Detokenizer threads
    (router, replica monitor)         <--tcp--  Replica 1: ...

SIGINT/SIGTERM stop uvicorn, then the replicas, then the Ray instance if this process started
it. Unlike the single-engine server, a replica dying does not stop the server: Ray restarts
it and the router takes it back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import uvicorn
import uvloop
import zmq

from runtime.channels import ZmqReceiver, ZmqSender
from runtime.heap import freeze_startup_heap
from runtime.model_files import load_tokenizer
from runtime.scale_out.front import STARTUP_TIMEOUT_S, ReplicaSet, RoutedTokenizerManager
from runtime.scale_out.replica import node_address
from runtime.scale_out.routing import Router, RouterConfig
from runtime.server.http_app import create_app
from runtime.server.http_protocol import StopSignal, bound_port, uvicorn_config
from runtime.server.state import ServerState
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def router_config(args: ServerArgs) -> RouterConfig:
    return RouterConfig(
        policy=args.router_policy,
        cache_threshold=args.router_cache_threshold,
        balance_abs=args.router_balance_abs_threshold,
        balance_rel=args.router_balance_rel_threshold,
        max_tree_tokens=args.router_max_tree_tokens,
        seed=args.random_seed,
    )


def launch_routed_server(args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM (returns 0); 1 if no replica ever started."""
    replicas = ReplicaSet(args)
    stop = StopSignal()  # after Ray's start, which must not take the signals over
    context = zmq.Context()
    inbox = ZmqReceiver.bind_tcp(context, node_address())
    try:
        replicas.start(inbox.address)
        tokenizer = load_tokenizer(args.model_path, args.tokenizer_path, args.chat_template)
        manager = RoutedTokenizerManager(
            tokenizer,
            replicas,
            Router(args.dp_size, router_config(args), alive=False),
            context,
            max_n=args.max_n,
        )
        state = ServerState(
            args,
            tokenizer,
            manager,
            process_info={
                "server_pid": os.getpid(),
                "dp_size": args.dp_size,
                "threads_per_replica": replicas.threads_per_replica,
                "front_address": inbox.address,
            },
        )
        if stop.signum is not None:
            return 0
        return uvloop.run(_serve(state, manager, inbox, context, stop))
    finally:
        replicas.shutdown()
        for handle in replicas.handles:
            if handle.sender is not None:
                handle.sender.close()
                handle.sender = None
        inbox.close()
        context.term()


async def _serve(
    state: ServerState,
    manager: RoutedTokenizerManager,
    inbox: ZmqReceiver,
    context: zmq.Context[Any],
    stop: StopSignal,
) -> int:
    loop = asyncio.get_running_loop()
    receiver = manager.start_receiver(inbox, loop)
    server = uvicorn.Server(uvicorn_config(create_app(state), state.args))
    stop.server = server
    done = threading.Event()
    exit_code = 0

    async def bring_up() -> None:
        nonlocal exit_code
        results = await asyncio.to_thread(manager.replicas.wait_all, STARTUP_TIMEOUT_S)
        for handle, (health, why) in zip(manager.replicas.handles, results, strict=True):
            if health is not None:
                manager.replica_up(handle.index, health)
            else:
                logger.error("replica %d did not start: %s", handle.index, why)
                handle.last_error = why
        if not any(h.alive for h in manager.replicas.handles):
            logger.error("no replica started; shutting down")
            exit_code = 1
            server.should_exit = True
            return
        manager.start_monitor(done)
        args = state.args
        freeze_startup_heap("router front", args)
        logger.info(
            "ready: %s at http://%s:%d, %d replicas", args.model_name, args.host,
            bound_port(server, args.port), args.dp_size,
        )  # fmt: skip

    startup = asyncio.create_task(bring_up())
    try:
        await server.serve()
    finally:
        done.set()
        startup.cancel()
        stopper = ZmqSender(context, inbox.address, bind=False)
        stopper.send(None)
        await asyncio.to_thread(receiver.join, 5.0)
        stopper.close()
        state.close()
    return exit_code
