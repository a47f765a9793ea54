"""The live dashboard's data: one poller per server, shared by every open page.

While at least one page watches, the poller asks the scheduler for a ``dashboard`` snapshot
(its server_info, the top ``DASHBOARD_MAX_NODES`` nodes of the radix tree, its last steps)
every ``UPDATE_INTERVAL_S``, decodes and shapes it here, and hands the same server-sent event
to every watcher; a slow watcher skips to the latest. Ten open pages cost the scheduler what
one does, and none costs anything once they are closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from runtime.errors import RequestError, SchedulerDied
from runtime.ipc import ControlCommand
from runtime.server.cache_tree import render_cache_tree, scheduler_call
from runtime.server.errors import ApiError
from runtime.server.state import ServerState
from runtime.server.streams import sse_event

logger = logging.getLogger(__name__)

UPDATE_INTERVAL_S = 0.5
DASHBOARD_MAX_NODES = 200
# Reconnect delay a browser's EventSource uses when the stream breaks.
RETRY_MS = 2000


class DashboardFeed:
    def __init__(
        self,
        state: ServerState,
        interval_s: float = UPDATE_INTERVAL_S,
        max_nodes: int = DASHBOARD_MAX_NODES,
    ) -> None:
        self.state = state
        self.interval_s = interval_s
        self.max_nodes = max_nodes
        self._latest = b""
        self._version = 0
        self._watchers = 0
        self._poller: asyncio.Task[None] | None = None
        self._updated: asyncio.Condition | None = None

    async def events(self) -> AsyncIterator[bytes]:
        """Server-sent events for one watcher: the latest update now (if fresh), then each new
        one; runs until the caller stops iterating (the page closes)."""
        if self._updated is None:
            self._updated = asyncio.Condition()
        self._watchers += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        try:
            yield f"retry: {RETRY_MS}\n\n".encode()
            seen = 0
            while True:
                async with self._updated:
                    while self._version == seen:
                        await self._updated.wait()
                    seen, event = self._version, self._latest
                yield event
        finally:
            self._watchers -= 1

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._watchers > 0:
                started = loop.time()
                await self._publish(sse_event(await self._update()))
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
        finally:
            self._latest, self._version = b"", 0  # a later watcher must not get stale data

    async def _publish(self, event: bytes) -> None:
        assert self._updated is not None
        async with self._updated:
            self._latest = event
            self._version += 1
            self._updated.notify_all()

    async def _update(self) -> dict[str, Any]:
        """One update, or ``{"error": message}`` when the scheduler cannot give one now."""
        state = self.state
        try:
            raw = await scheduler_call(
                state, ControlCommand.DASHBOARD, {"max_nodes": self.max_nodes}
            )
            tree = await render_cache_tree(state, raw["cache_tree"], self.max_nodes)
        except (ApiError, RequestError, SchedulerDied) as exc:
            return {"error": str(exc), "time": time.time()}
        except Exception:  # a bug here must not leave the pages waiting forever
            logger.exception("building a dashboard update failed")
            return {"error": "building the update failed; the server log has details"}
        return {
            "time": time.time(),
            "model": state.args.model_name,
            "server_info": raw["server_info"],
            "tree": tree,
            "steps": [step._asdict() for step in raw["steps"]],
            "latency": state.metrics.recent_percentiles(),
        }
