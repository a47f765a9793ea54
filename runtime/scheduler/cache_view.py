"""Snapshots of the scheduler's radix tree for observers (``/cache_tree``, the live dashboard).

The scheduler calls ``snapshot`` when a control message asks for one; its cost is bounded by
the nodes it returns (``radix_cache.snapshot_tree``), never by the size of the tree. Besides
the tree's own view it adds what only a process watching over time can know:

- when each node was last used, in seconds: the tree keeps a logical clock, and ``ClockTimeline``
  remembers when the clock passed which value (``note_clock`` each scheduler step);
- which nodes were evicted lately: nodes shown by the previous snapshot that the tree has
  evicted since, kept for ``EVICTED_KEPT_S``;
- where recent requests sit in the tree: each finished request's cached path, found once
  (read-only) the first time a snapshot lists it.

Token ids go out as ids: decoding them is the HTTP process's job, not the scheduler's. Cache
salts never go out: each namespace root and request is labelled by ``salt_label`` instead, so
that an observer can tell tenants apart without learning what would let it share their cache.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from radix_cache import RadixCache, TreeNode
from radix_cache.snapshot import NodeView, cached_path, pack_views, path_tokens, snapshot_tree
from runtime.scheduler.activity_log import RequestRecord

EVICTED_KEPT_S = 5.0
# At most this many evicted nodes are reported (the most recent).
EVICTED_MAX = 100
TIMELINE_SPACING_S = 0.25
TIMELINE_KEPT = 8192  # at 4 entries a second, the last half hour of activity at least


def salt_label(namespace: Hashable) -> str | None:
    """How observers see a cache salt: None for no salt, else ``salt:`` and the first 12 hex
    digits of its SHA-256 (a stable name for a tenant that does not give the salt away)."""
    if namespace is None:
        return None
    return "salt:" + hashlib.sha256(str(namespace).encode()).hexdigest()[:12]


class ClockTimeline:
    """When the tree's logical clock passed which values, at TIMELINE_SPACING_S resolution:
    entry ``i`` says the clock values in ``(clocks[i-1], clocks[i]]`` were read within
    TIMELINE_SPACING_S plus one scheduler step of ``times[i]`` (time.monotonic()): the first of
    them was noted then, at the start of the step after the one that read it."""

    def __init__(self) -> None:
        self.clocks: list[int] = []
        self.times: list[float] = []
        self.trimmed = False  # the oldest entries were dropped

    def note(self, clock: int, now: float) -> None:
        if self.clocks and clock == self.clocks[-1]:
            return
        if self.clocks and clock < self.clocks[-1]:  # the tree was reset
            self.clocks, self.times, self.trimmed = [], [], False
        if self.times and now - self.times[-1] < TIMELINE_SPACING_S:
            self.clocks[-1] = clock
            return
        self.clocks.append(clock)
        self.times.append(now)
        if len(self.clocks) > 2 * TIMELINE_KEPT:
            del self.clocks[:TIMELINE_KEPT], self.times[:TIMELINE_KEPT]
            self.trimmed = True

    def seconds_since(self, clock: int, now: float) -> float | None:
        """About how long before ``now`` the clock read ``clock``: None when that is older
        than the history kept."""
        i = bisect.bisect_left(self.clocks, clock)
        if i == len(self.clocks):
            return 0.0  # read since the last note: in the current step
        if i == 0 and self.trimmed:
            return None
        return max(now - self.times[i], 0.0)


class CacheView:
    def __init__(self, tree: RadixCache | None) -> None:
        self.tree = tree
        self.timeline = ClockTimeline()
        # The last snapshot's nodes and views (parallel lists; few objects survive to the next
        # snapshot, so the garbage collector has little to promote), and their uids' places.
        self._shown_nodes: list[TreeNode] = []
        self._shown_views: list[NodeView] = []
        self._shown_at: dict[int, int] = {}
        self._evicted: deque[tuple[float, NodeView]] = deque(maxlen=EVICTED_MAX)
        self._paths: dict[str, tuple[list[TreeNode], int]] = {}  # by request id

    def note_clock(self) -> None:
        """Called once per scheduler step: remember when the tree's clock moved."""
        if self.tree is not None:
            self.timeline.note(self.tree.clock, time.monotonic())

    def snapshot(self, max_nodes: int, requests: list[RequestRecord]) -> dict[str, Any]:
        """The top ``max_nodes`` nodes, the nodes evicted lately and ``requests``' paths, as
        plain data (NodeViews with token ids). Raises ValueError unless ``max_nodes >= 1``."""
        started = time.perf_counter()
        if self.tree is None:
            return {"enabled": False}
        now = time.monotonic()
        self.note_clock()
        snap = snapshot_tree(self.tree, max_nodes)
        self._note_evictions(now)
        self._shown_nodes, self._shown_views = snap.tree_nodes, snap.nodes
        self._shown_at = {view.uid: i for i, view in enumerate(snap.nodes)}
        ages = [self.timeline.seconds_since(view.last_access, now) for view in snap.nodes]
        while self._evicted and now - self._evicted[0][0] > EVICTED_KEPT_S:
            self._evicted.popleft()
        nodes, token_ids = pack_views(snap.nodes)
        evicted, evicted_ids = pack_views([view for _, view in self._evicted])
        return {
            "enabled": True,
            "nodes": nodes,  # packed: radix_cache.snapshot.unpack_views(nodes, token_ids)
            "token_ids": token_ids,
            "last_access_s": ages,
            "stats": snap.stats,
            "clock": snap.clock,
            "scanned": snap.scanned,
            "evicted": evicted,
            "evicted_token_ids": evicted_ids,
            "evicted_s_ago": [now - at for at, _ in self._evicted],
            "requests": self._request_paths(requests),
            # Each shown namespace root's label (uid -> salt_label).
            "namespaces": {uid: salt_label(ns) for uid, ns in snap.namespaces.items()},
            "folded_roots": snap.folded_roots,
            "folded_root_tokens": snap.folded_root_tokens,
            "snapshot_ms": 1e3 * (time.perf_counter() - started),
        }

    def prefix(self, uid: int) -> tuple[np.ndarray, int] | str:
        """The token ids of the whole prefix node ``uid`` ends and how many of them are the
        node's own (the last ones), if the last snapshot showed it and it is still cached;
        else why not (a message)."""
        at = self._shown_at.get(uid)
        if at is None:
            return f"node {uid} is not in the latest snapshot (folded, evicted or unknown)"
        node = self._shown_nodes[at]
        if node.evicted:
            return f"node {uid} was evicted"
        return path_tokens(node), node.key.size

    def _note_evictions(self, now: float) -> None:
        for node, view in zip(self._shown_nodes, self._shown_views, strict=True):
            if node.evicted:  # copies of its runs: the node's own arrays can go
                self._evicted.append(
                    (now, view._replace(head=view.head.copy(), tail=view.tail.copy()))
                )

    def _request_paths(self, requests: list[RequestRecord]) -> list[dict[str, Any]]:
        """Each request's record (without its token ids) and its path: the uids of the nodes
        that held its tokens when a snapshot first listed it, how many tokens they held, and
        how many of those nodes the tree has evicted since."""
        assert self.tree is not None
        paths = {
            r.rid: self._paths.get(r.rid)
            or cached_path(self.tree, r.token_ids, r.cache_salt, r.locked_node)
            for r in requests
        }
        self._paths = paths
        listed = []
        for record in requests:
            nodes, cached_len = paths[record.rid]
            listed.append(
                {
                    "rid": record.rid,
                    "finished_at": record.finished_at,
                    "latency_s": record.latency_s,
                    "prompt_tokens": record.prompt_tokens,
                    "cached_tokens": record.cached_tokens,
                    "completion_tokens": record.completion_tokens,
                    "finish_reason": record.finish_reason,
                    "path": [node.uid for node in nodes],
                    "path_tokens": cached_len,
                    "path_evicted": sum(node.evicted for node in nodes),
                    "namespace": salt_label(record.cache_salt),
                }
            )
        return listed
