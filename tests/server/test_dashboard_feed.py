"""DashboardFeed: one poll of the scheduler per update, whatever the number of open pages, and
none once they are closed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from runtime.errors import SchedulerDied
from runtime.server.child_process import free_port
from runtime.server.dashboard import feed as feed_module
from runtime.server.dashboard.feed import DashboardFeed
from runtime.server.http_app import create_app
from runtime.server.metrics import ServerMetrics


class FakeScheduler:
    def __init__(self) -> None:
        self.calls = 0
        self.dead = False

    async def call(self, state: Any, command: str, args: dict[str, Any]) -> dict[str, Any]:
        assert command == "dashboard" and args == {"max_nodes": 7}
        if self.dead:
            raise SchedulerDied("the scheduler stopped: test")
        self.calls += 1
        return {"server_info": {"poll": self.calls}, "cache_tree": {}, "steps": []}


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> FakeScheduler:
    fake = FakeScheduler()

    async def render(state: Any, raw: dict[str, Any], max_nodes: int) -> dict[str, Any]:
        return {"nodes": [], "requests": []}

    monkeypatch.setattr(feed_module, "scheduler_call", fake.call)
    monkeypatch.setattr(feed_module, "render_cache_tree", render)
    return fake


def make_feed() -> DashboardFeed:
    state = SimpleNamespace(args=SimpleNamespace(model_name="tiny"), metrics=ServerMetrics())
    return DashboardFeed(state, interval_s=0.05, max_nodes=7)  # type: ignore[arg-type]


async def updates(stream: Any, count: int) -> list[dict[str, Any]]:
    assert (await stream.__anext__()).startswith(b"retry: ")
    received = []
    for _ in range(count):
        event = await stream.__anext__()
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        received.append(json.loads(event[len(b"data: ") :]))
    return received


def test_watchers_share_one_poll_per_update_and_polling_stops_without_them(
    scheduler: FakeScheduler,
):
    async def scenario() -> None:
        feed = make_feed()
        first, second = feed.events(), feed.events()
        a, b = await asyncio.gather(updates(first, 5), updates(second, 5))
        polls_a = [u["server_info"]["poll"] for u in a]
        polls_b = [u["server_info"]["poll"] for u in b]
        assert polls_a == sorted(set(polls_a)) and set(polls_a) & set(polls_b)
        assert scheduler.calls <= 7  # two watchers, five updates each: shared polls
        await first.aclose()
        await second.aclose()
        await asyncio.sleep(0.2)
        stopped_at = scheduler.calls
        await asyncio.sleep(0.2)
        assert scheduler.calls == stopped_at  # nobody watches: no polling
        again = await updates(feed.events(), 1)  # a new watcher gets fresh data, not stale
        assert again[0]["server_info"]["poll"] > stopped_at

    asyncio.run(scenario())


def test_a_dead_scheduler_becomes_an_error_update(scheduler: FakeScheduler):
    async def scenario() -> None:
        scheduler.dead = True
        stream = make_feed().events()
        (update,) = await updates(stream, 1)
        assert "the scheduler stopped" in update["error"]
        await stream.aclose()

    asyncio.run(scenario())


def test_closing_the_page_ends_its_watch(scheduler: FakeScheduler):
    """Through the real ASGI server: a client that goes away stops counting as a watcher, and
    the scheduler is no longer polled."""
    state = SimpleNamespace(
        args=SimpleNamespace(
            api_key=None, admin_api_key=None, api_keys_file=None, model_name="tiny"
        ),
        metrics=ServerMetrics(),
        tracing=None,
    )
    app = create_app(state)  # type: ignore[arg-type]
    feed: DashboardFeed = app.state.dashboard_feed
    feed.interval_s, feed.max_nodes = 0.05, 7
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/dashboard/events"
        with httpx.stream("GET", url, timeout=10) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert [json.loads(next(lines)[6:])["model"] for _ in range(3)] == ["tiny"] * 3
        deadline = time.monotonic() + 5
        while feed._watchers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert feed._watchers == 0
        time.sleep(0.2)
        polls = scheduler.calls
        time.sleep(0.3)
        assert scheduler.calls == polls
    finally:
        server.should_exit = True
        thread.join(10)
