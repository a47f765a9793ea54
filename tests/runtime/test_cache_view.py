"""The scheduler's side of /cache_tree: CacheView (snapshots, ages, evicted nodes, request
paths, prefixes), its ClockTimeline, and the ActivityLog it reads requests from."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.snapshot import NodeView, unpack_views
from runtime.scheduler import cache_view
from runtime.scheduler.activity_log import ActivityLog, RequestRecord
from runtime.scheduler.cache_view import TIMELINE_SPACING_S, CacheView, ClockTimeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cache_view.time, "monotonic", fake)
    return fake


def insert(cache: RadixCache, ids: np.ndarray) -> None:
    slots = cache.allocator.alloc(ids.size)
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(ids, slots)])


def views(snap: dict) -> list[NodeView]:
    """The snapshot's nodes (packed, to pickle fast) as NodeViews."""
    return unpack_views(snap["nodes"], snap["token_ids"])


def evicted(snap: dict) -> list[tuple[float, int]]:
    """(seconds ago, uid) of the nodes the snapshot reports evicted lately."""
    gone = unpack_views(snap["evicted"], snap["evicted_token_ids"])
    return list(zip(snap["evicted_s_ago"], [v.uid for v in gone], strict=True))


def record(rid: str, ids: np.ndarray) -> RequestRecord:
    return RequestRecord(rid, 0.0, 0.1, ids.size - 2, 0, 2, {"type": "length"}, ids, None)


def test_timeline_maps_clock_readings_to_seconds():
    timeline = ClockTimeline()
    timeline.note(3, now=10.0)
    timeline.note(5, now=10.0 + TIMELINE_SPACING_S / 2)  # same entry: within the spacing
    timeline.note(9, now=20.0)
    assert timeline.clocks == [5, 9]
    assert timeline.seconds_since(1, now=25.0) == pytest.approx(15.0)
    assert timeline.seconds_since(5, now=25.0) == pytest.approx(15.0)
    assert timeline.seconds_since(7, now=25.0) == pytest.approx(5.0)
    assert timeline.seconds_since(10, now=25.0) == 0.0  # not noted yet: this step
    timeline.note(2, now=30.0)  # the tree was reset: its clock starts over
    assert timeline.clocks == [2] and timeline.seconds_since(1, now=31.0) == pytest.approx(1.0)


def test_snapshot_ages_and_plain_data(clock: FakeClock):
    cache = RadixCache(KVSlotAllocator(4096))
    view = CacheView(cache)
    insert(cache, np.arange(1, 30, dtype=np.int32))
    view.note_clock()
    clock.now += 30.0
    insert(cache, np.arange(100, 110, dtype=np.int32))
    view.note_clock()
    clock.now += 2.0
    snap = view.snapshot(10, [])
    heads = [int(v.head[0]) if v.head.size else 0 for v in views(snap)]
    ages = dict(zip(heads, snap["last_access_s"], strict=True))
    assert ages[1] == pytest.approx(32.0) and ages[100] == pytest.approx(2.0)
    assert snap["stats"] == cache.stats() and evicted(snap) == []
    pickle.dumps(snap)  # crosses to the HTTP process: no tree nodes inside
    assert "tree_nodes" not in snap


def test_nodes_shown_then_evicted_are_reported_for_a_while(clock: FakeClock):
    cache = RadixCache(KVSlotAllocator(4096))
    view = CacheView(cache)
    insert(cache, np.arange(1, 30, dtype=np.int32))
    insert(cache, np.arange(100, 140, dtype=np.int32))
    shown = {int(v.head[0]): v.uid for v in views(view.snapshot(10, [])) if v.head.size}
    cache.evict(1)  # the least recently used leaf: the first sequence
    clock.now += 1.0
    assert evicted(view.snapshot(10, [])) == [(0.0, shown[1])]
    clock.now += 3.0
    assert evicted(view.snapshot(10, [])) == [(3.0, shown[1])]
    clock.now += cache_view.EVICTED_KEPT_S
    assert evicted(view.snapshot(10, [])) == []


def test_request_paths_and_prefixes(clock: FakeClock):
    cache = RadixCache(KVSlotAllocator(4096))
    view = CacheView(cache)
    a = np.arange(1, 40, dtype=np.int32)
    b = np.concatenate([a[:20], np.arange(200, 210, dtype=np.int32)])
    insert(cache, a)
    insert(cache, b)
    snap = view.snapshot(10, [record("r-a", a), record("r-b", b)])
    by_rid = {r["rid"]: r for r in snap["requests"]}
    uids = {v.uid: v for v in views(snap)}
    assert [uids[u].tokens for u in by_rid["r-a"]["path"]] == [20, 19]
    assert by_rid["r-b"]["path_tokens"] == 30 and by_rid["r-b"]["path_evicted"] == 0
    assert "token_ids" not in by_rid["r-a"]
    ids, own = view.prefix(by_rid["r-b"]["path"][-1])
    assert np.array_equal(ids, b) and own == 10
    assert "not in the latest snapshot" in view.prefix(10**9)
    cache.evict(cache.total_size())
    assert "was evicted" in view.prefix(by_rid["r-b"]["path"][-1])
    again = {r["rid"]: r for r in view.snapshot(10, [record("r-a", a)])["requests"]}
    assert again["r-a"]["path_evicted"] == 2  # found once, then watched


def test_salted_requests_are_shown_under_their_salts_label_never_their_salt():
    cache = RadixCache(KVSlotAllocator(4096))
    view = CacheView(cache)
    ids = np.arange(1, 40, dtype=np.int32)
    salts = ("tenant-a", None)
    for salt in salts:
        slots = cache.allocator.alloc(ids.size)
        assert slots is not None and cache.insert(ids, slots, salt) == 0
    requests = [record(f"r{i}", ids)._replace(cache_salt=salt) for i, salt in enumerate(salts)]
    snap = view.snapshot(10, requests)
    assert "tenant-a" not in repr(pickle.dumps(snap))  # what leaves the scheduler
    label = cache_view.salt_label("tenant-a")
    assert label is not None and label.startswith("salt:") and len(label) == 17
    assert sorted(snap["namespaces"].values(), key=str) == [None, label]
    roots = {ns: uid for uid, ns in snap["namespaces"].items()}
    parents = {v.uid: v.parent_uid for v in views(snap)}
    for listed, salt in zip(snap["requests"], (label, None), strict=True):
        assert listed["namespace"] == salt and listed["path_tokens"] == ids.size
        assert parents[listed["path"][0]] == roots[salt]  # its path starts at its salt's root


def test_without_a_tree():
    assert CacheView(None).snapshot(10, []) == {"enabled": False}


def test_activity_log_keeps_the_last_steps_and_requests():
    log = ActivityLog(steps_kept=3, requests_kept=2)
    for i in range(5):
        log.record_step([], [], retracted=i, running=0, waiting=0)
    assert [s.step for s in log.steps()] == [3, 4, 5]
    assert [s.retracted for s in log.steps()] == [2, 3, 4]
