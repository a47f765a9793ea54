"""The HTTP front of ``arbor serve --dp N``: one tokenizer manager routing to N Ray replicas.

The front is the ordinary server process (FastAPI, the native and OpenAI APIs, streaming,
tokenization and chat templates done once) whose tokenizer manager sends each tokenized
request to one replica chosen by a ``Router`` instead of to its own scheduler. Replicas
(``runtime.scale_out.replica``) are Ray actors, placed by Ray on this machine or across a
cluster, restarted by Ray when they die. Outputs of every replica come back to one ZMQ inbox.

Faults: a replica is polled for health every ``HEALTH_INTERVAL_S``. When it stops answering (or
reports its scheduler crashed) it is marked dead: requests routed to it that have produced no
output yet are sent once more to another replica; the others fail with a 503 naming the
replica. Ray restarts the actor (``--dp-max-restarts``); once its health answers again, with a
new incarnation, the router takes it back (with an empty picture of its cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from runtime.channels import ZmqSender
from runtime.errors import RequestError, SchedulerDied
from runtime.ipc import (
    AbortRequest,
    ControlCommand,
    ControlRequest,
    GenerateRequest,
    PinPrefix,
    ProgramRelease,
    TextOutput,
)
from runtime.scale_out.reaper import mark_and_watch
from runtime.scale_out.replica import Replica, ReplicaFailed, ReplicaReady
from runtime.scale_out.routing import Router
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 600.0

# server_info keys that add up over replicas; rates and sizes of the whole deployment.
SUMMED_KEYS = (
    "prompt_tokens", "cached_tokens", "generated_tokens", "requests_finished", "forward_steps",
    "draft_tokens_proposed", "draft_tokens_accepted", "spec_draft_tokens",
    "spec_accepted_tokens", "spec_verify_steps", "emit_steps", "kv_used_tokens",
    "kv_cached_tokens", "kv_free_tokens", "max_total_tokens", "num_running_reqs",
    "num_waiting_reqs", "num_grammar_queue_reqs", "num_retracted_reqs", "gen_throughput",
    "prefix_cache_queries_tokens", "prefix_cache_hits_tokens",
    "kv_disk_hits_tokens", "kv_disk_loads", "kv_disk_load_bytes", "kv_disk_load_seconds",
    "kv_disk_writes", "kv_disk_write_bytes", "kv_disk_write_errors", "kv_disk_used_bytes",
)  # fmt: skip
# Per-replica facts shown in server_info["replicas"].
REPLICA_KEYS = (
    "cache_hit_rate", "kv_usage", "kv_cache_utilization", "kv_used_tokens", "kv_cached_tokens",
    "kv_free_tokens", "num_running_reqs", "num_waiting_reqs", "prompt_tokens", "cached_tokens",
    "generated_tokens", "requests_finished", "gen_throughput", "prefix_cache_queries_tokens",
    "prefix_cache_hits_tokens", "num_kv_pins", "kv_pinned_tokens",
)  # fmt: skip


@dataclass
class ReplicaHandle:
    index: int
    actor: Any
    alive: bool = False
    incarnation: str | None = None
    address: str | None = None
    sender: ZmqSender | None = None
    health: dict[str, Any] = field(default_factory=dict)
    restarts: int = -1  # incarnations seen, minus the first
    last_error: str | None = None


@dataclass
class _InFlight:
    replica: int
    message: GenerateRequest
    output_ids: list[int] = field(default_factory=list)
    streamed: bool = False
    retried: bool = False


class ReplicaSet:
    """N replica actors on Ray (a local instance started here, or the cluster at
    ``ray_address``), each told to send to ``front_address``."""

    def __init__(self, args: ServerArgs) -> None:
        """Join (or start) Ray; ``start`` then creates the actors."""
        import ray

        self.args = args
        self.handles: list[ReplicaHandle] = []
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            if args.ray_address is None:  # a local instance: cleaned up even if we are killed
                mark_and_watch()
            ray.init(
                address=args.ray_address,
                include_dashboard=False,
                configure_logging=False,
                log_to_driver=True,
            )

    def start(self, front_address: str) -> None:
        """Create the replica actors, each told to send to ``front_address``."""
        import ray

        args = self.args
        resources = ray.cluster_resources()
        dp = args.dp_size
        tp = getattr(args, "tp_size", 1)
        cpus = max(1, int(resources.get("CPU", os.cpu_count() or 1)) // dp)
        wants_gpu = args.device == "auto" or args.device.startswith("cuda")
        gpus = tp if wants_gpu and resources.get("GPU", 0) >= dp * tp else 0
        actor_class = ray.remote(Replica).options(
            num_cpus=cpus,
            num_gpus=gpus,
            max_restarts=args.dp_max_restarts,
            max_task_retries=0,
            name=None,
        )
        self.threads_per_replica = cpus
        fraction = args.mem_fraction_static
        if gpus == 0 and self._started_ray and fraction is not None:
            # All replicas share this machine's memory: each sizes its KV pool from its share
            # (the default CPU pool is capped, runtime/kv_budget.py).
            args = dataclasses.replace(args, mem_fraction_static=fraction / dp)
        self.handles = [
            ReplicaHandle(i, actor_class.remote(args, i, front_address, cpus)) for i in range(dp)
        ]

    def check(self, handle: ReplicaHandle, timeout: float) -> tuple[dict[str, Any] | None, str]:
        """(health, "") if the replica answers and serves, else (None, why)."""
        import ray

        try:
            health = ray.get(handle.actor.health.remote(), timeout=timeout)
        except Exception as exc:  # dead, restarting, or too slow
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not health.get("ok"):
            return None, str(health.get("error") or "not serving")
        return health, ""

    def wait_all(self, timeout: float) -> list[tuple[dict[str, Any] | None, str]]:
        """Wait until every replica has started (or ``timeout``); each one's first health."""
        import ray

        deadline = time.monotonic() + timeout
        refs = [h.actor.health.remote() for h in self.handles]
        results: list[tuple[dict[str, Any] | None, str]] = []
        for ref in refs:
            try:
                health = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                ok = bool(health.get("ok"))
                results.append((health if ok else None, "" if ok else str(health.get("error"))))
            except Exception as exc:
                results.append((None, f"{type(exc).__name__}: {exc}"))
        return results

    def kill(self, index: int) -> None:
        """Kill one replica's actor (Ray restarts it): for tests and operators."""
        import ray

        ray.kill(self.handles[index].actor, no_restart=False)

    def shutdown(self) -> None:
        import ray

        for handle in self.handles:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # already gone
                pass
        if self._started_ray:
            ray.shutdown()


class RoutedTokenizerManager(TokenizerManager):
    """The tokenizer manager of a routed server: generate requests go to the replica the
    router picks, aborts follow them, control calls go to every live replica and their
    replies are merged."""

    def __init__(
        self,
        tokenizer: Any,
        replicas: ReplicaSet,
        router: Router,
        context: zmq.Context[Any],
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, _RoutingSender(self), **kwargs)
        self.replicas = replicas
        self.router = router
        self.context = context
        self.inflight: dict[str, _InFlight] = {}
        self.retried_requests = 0
        self.failed_over_requests = 0
        self.replica_info: dict[int, dict[str, Any]] = {}
        # Compiled programs stay on one replica (their pinned KV is there).
        self.program_replicas: dict[str, int] = {}

    @property
    def serving(self) -> bool:
        return self.ready.is_set() and any(h.alive for h in self.replicas.handles)

    # ---- routing (on the event loop) ------------------------------------------------------

    def route(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            self._send_generate(_InFlight(-1, message), exclude=())
        elif isinstance(message, AbortRequest):
            entry = self.inflight.get(message.rid)
            if entry is not None:
                self._send(entry.replica, message)
        elif isinstance(message, PinPrefix):
            # To the live replica the router saw the longest prefix of these tokens on: the
            # one that ran the turn, unless it died since.
            live = self.router.live()
            if live:
                trees, ids, salt = self.router.trees, message.token_ids, message.cache_salt
                self._send(max(live, key=lambda r: trees[r].match(ids, salt)), message)
        elif isinstance(message, ProgramRelease):
            replica = self.program_replicas.get(message.program)
            if message.branches is None:
                self.program_replicas.pop(message.program, None)
            if replica is not None and self.replicas.handles[replica].alive:
                self._send(replica, message)
        else:
            raise TypeError(f"a routed server does not route {type(message).__name__}")

    def _send_generate(self, entry: _InFlight, exclude: tuple[int, ...]) -> bool:
        step = entry.message.program
        chosen = self.program_replicas.get(step.program) if step is not None else None
        if chosen is None or chosen in exclude or not self.replicas.handles[chosen].alive:
            # (a program moved off a dead replica starts over from the new one's cache)
            chosen = self.router.choose(
                entry.message.input_ids,
                exclude=exclude,
                cache_salt=entry.message.cache_salt,
                routing_key=entry.message.routing_key,
            )
            if step is not None and chosen is not None:
                self.program_replicas[step.program] = chosen
        else:
            self.router.assign(chosen, entry.message.input_ids, "program", entry.message.cache_salt)
        if chosen is None:
            self._fail_request(entry.message.rid, "no replica is serving; retry later")
            return False
        entry.replica = chosen
        self.inflight[entry.message.rid] = entry
        self._send(chosen, entry.message)
        return True

    def _send(self, replica: int, message: Any) -> None:
        sender = self.replicas.handles[replica].sender
        if sender is not None:
            sender.send(message)

    def _fail_request(self, rid: str, why: str) -> None:
        self.inflight.pop(rid, None)
        state = self._requests.get(rid)
        if state is None:
            return
        if state.draining:  # nobody waits; nothing will release it
            del self._requests[rid]
        else:
            state.queue.put_nowait(RequestError(why, 503))

    def _observe(self, out: TextOutput) -> None:
        entry = self.inflight.get(out.rid)
        if entry is None:
            return
        entry.streamed = True
        entry.output_ids.extend(out.new_token_ids)
        if out.finished_reason is not None:
            del self.inflight[out.rid]
            tokens = [*entry.message.input_ids, *entry.output_ids]
            self.router.finished(entry.replica, tokens, entry.message.cache_salt)

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, ReplicaReady):
            self.replica_info[message.replica] = message.info
            self._maybe_ready()
        elif isinstance(message, ReplicaFailed):
            self.replica_down(message.replica, f"its scheduler failed: {message.error}")
        else:
            super()._dispatch(message)

    # ---- replicas coming and going --------------------------------------------------------

    def replica_up(self, index: int, health: dict[str, Any]) -> None:
        handle = self.replicas.handles[index]
        if handle.alive and handle.incarnation == health["incarnation"]:
            handle.health = health
            return
        if handle.alive:  # restarted between two polls: what it ran is lost
            self.replica_down(index, "it restarted")
        if handle.sender is not None:
            handle.sender.close()
        handle.sender = ZmqSender(self.context, health["address"], bind=False)
        handle.address, handle.incarnation, handle.health = (
            health["address"], health["incarnation"], health
        )  # fmt: skip
        handle.restarts += 1
        handle.alive = True
        self.router.mark_alive(index)
        self._maybe_ready()
        logger.info("replica %d serving at %s (pid %s)", index, handle.address, health["pid"])

    def _maybe_ready(self) -> None:
        """Ready once a replica both serves and has said what it runs (context length...)."""
        if self.ready.is_set():
            return
        for handle in self.replicas.handles:
            if handle.alive and handle.index in self.replica_info:
                self.server_info = self.replica_info[handle.index]
                self.ready.set()
                return

    def replica_down(self, index: int, why: str) -> None:
        handle = self.replicas.handles[index]
        if not handle.alive:
            return
        logger.error("replica %d is down: %s", index, why)
        handle.alive = False
        handle.last_error = why
        self.router.mark_dead(index)
        if handle.sender is not None:
            handle.sender.close()
            handle.sender = None
        for rid, entry in list(self.inflight.items()):
            if entry.replica != index:
                continue
            state = self._requests.get(rid)
            if (
                not entry.streamed
                and not entry.retried
                and state is not None
                and not state.draining
            ):
                entry.retried = True
                self.retried_requests += 1
                self._send_generate(entry, exclude=(index,))
            else:
                self.failed_over_requests += 1
                self._fail_request(rid, f"replica {index} failed ({why}); the request was lost")

    def start_monitor(self, stop: threading.Event) -> threading.Thread:
        """Poll every replica's health on a thread; report changes to the event loop."""
        loop = self.loop
        assert loop is not None

        def poll() -> None:
            while not stop.is_set():
                for handle in self.replicas.handles:
                    health, why = self.replicas.check(handle, HEALTH_TIMEOUT_S)
                    if stop.is_set():
                        return
                    if health is not None:
                        loop.call_soon_threadsafe(self.replica_up, handle.index, health)
                    else:
                        loop.call_soon_threadsafe(self.replica_down, handle.index, why)
                stop.wait(HEALTH_INTERVAL_S)

        thread = threading.Thread(target=poll, name="replica-monitor", daemon=True)
        thread.start()
        return thread

    # ---- control calls ----------------------------------------------------------------------

    async def control(
        self, command: ControlCommand, timeout: float = 60.0, args: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Ask every live replica; merge their replies (server_info: sums and per-replica
        rows; flush_cache and check_invariants: all must succeed). Other commands (the
        dashboard's cache_tree, dashboard, node_prefix) ask the first live replica alone:
        node ids are a replica's own."""
        assert self.loop is not None
        live = [h for h in self.replicas.handles if h.alive]
        if not live:
            raise SchedulerDied("no replica is serving")
        if command not in ("server_info", "flush_cache", "check_invariants"):
            live = live[:1]
        futures: dict[int, asyncio.Future[dict[str, Any]]] = {}
        request_ids = []
        for handle in live:
            request_id = uuid.uuid4().hex
            request_ids.append(request_id)
            futures[handle.index] = self._controls[request_id] = self.loop.create_future()
            self._send(handle.index, ControlRequest(request_id, command, args or {}))
        try:
            replies = await asyncio.wait_for(asyncio.gather(*futures.values()), timeout)
        finally:
            for request_id in request_ids:
                self._controls.pop(request_id, None)
        by_replica = dict(zip(futures, replies, strict=True))
        if command == "flush_cache":
            ok = all(reply.get("success") for reply in replies)
            if ok:
                self.router.reset_trees()
            return {"success": ok}
        if command == "check_invariants":
            errors = [
                f"replica {i}: {r.get('error')}" for i, r in by_replica.items() if not r["ok"]
            ]
            return {"ok": not errors, "error": "; ".join(errors) or None}
        if command == "server_info":
            return self._merge_info(by_replica)
        return replies[0]

    def _merge_info(self, by_replica: dict[int, dict[str, Any]]) -> dict[str, Any]:
        first = next(iter(by_replica.values()))
        merged = dict(first)
        for key in SUMMED_KEYS:
            values = [r[key] for r in by_replica.values() if isinstance(r.get(key), (int, float))]
            if values:
                merged[key] = sum(values)
        prompt = merged.get("prompt_tokens") or 0
        merged["cache_hit_rate"] = merged.get("cached_tokens", 0) / prompt if prompt else 0.0
        capacity = merged.get("max_total_tokens") or 0
        merged["kv_usage"] = merged.get("kv_used_tokens", 0) / capacity if capacity else 0.0
        free = merged.get("kv_free_tokens", 0)
        merged["kv_cache_utilization"] = 1.0 - free / capacity if capacity else 0.0
        rows = []
        for handle in self.replicas.handles:
            reply = by_replica.get(handle.index, {})
            row: dict[str, Any] = {
                "replica": handle.index,
                "alive": handle.alive,
                "pid": handle.health.get("pid"),
                "node": handle.health.get("node"),
                "address": handle.address,
                "restarts": max(handle.restarts, 0),
                "last_error": handle.last_error,
                "in_flight": self.router.load[handle.index],
            }
            row.update({k: reply[k] for k in REPLICA_KEYS if k in reply})
            rows.append(row)
        merged["replicas"] = rows
        merged["router"] = {
            **self.router.stats(),
            "retried_requests": self.retried_requests,
            "failed_over_requests": self.failed_over_requests,
        }
        return merged


class _RoutingSender:
    """What the base tokenizer manager sends through: the router."""

    def __init__(self, manager: RoutedTokenizerManager) -> None:
        self.manager = manager

    def send(self, message: Any) -> None:
        self.manager.route(message)
