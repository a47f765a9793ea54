"""Orders the waiting queue before admission: cache-aware policies behind one interface.

``lpm`` puts the longest cached prefix first (falling back to arrival order on long queues,
where matching every request each step would cost more than it saves); ``dfs-weight`` walks
the radix tree depth-first, heaviest subtree first, so requests sharing a prefix run together;
``fcfs`` is arrival order. Requests that waited past the starvation timeout always go first.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import defaultdict

from radix_cache import TreeNode
from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Req], kv: KVCacheManager) -> list[Req]:
        """Return ``waiting`` in the order admission should consider it."""


class FCFS(SchedulePolicy):
    def order(self, waiting: list[Req], kv: KVCacheManager) -> list[Req]:
        return sorted(waiting, key=lambda r: r.arrival)


class LongestPrefixMatch(SchedulePolicy):
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue

    def order(self, waiting: list[Req], kv: KVCacheManager) -> list[Req]:
        if kv.tree is None or len(waiting) > self.max_queue:
            return FCFS().order(waiting, kv)
        prefix = {id(r): kv.cached_prefix_len(r) for r in waiting}
        return sorted(waiting, key=lambda r: (-prefix[id(r)], r.arrival))


class DFSWeight(SchedulePolicy):
    def order(self, waiting: list[Req], kv: KVCacheManager) -> list[Req]:
        if kv.tree is None:
            return FCFS().order(waiting, kv)
        at_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, TreeNode] = {}
        for req in sorted(waiting, key=lambda r: r.arrival):
            node = kv.cached_prefix(req).node
            at_node[id(node)].append(req)
            nodes[id(node)] = node
        weight: dict[int, int] = defaultdict(int)
        roots: dict[int, TreeNode] = {}
        for key, node in nodes.items():
            count, cursor = len(at_node[key]), node
            while cursor.parent is not None:
                weight[id(cursor)] += count
                cursor = cursor.parent
            weight[id(cursor)] += count
            roots[id(cursor)] = cursor
        ordered: list[Req] = []
        stack = sorted(roots.values(), key=lambda n: weight[id(n)])
        while stack:
            node = stack.pop()
            ordered.extend(at_node.get(id(node), []))
            children = [c for c in node.children.values() if weight.get(id(c))]
            stack.extend(sorted(children, key=lambda n: weight[id(n)]))
        return ordered


def make_policy(name: str, lpm_max_queue: int) -> SchedulePolicy:
    if name == "lpm":
        return LongestPrefixMatch(lpm_max_queue)
    if name == "dfs-weight":
        return DFSWeight()
    if name == "fcfs":
        return FCFS()
    raise ValueError(f"unknown schedule policy {name!r}")


def with_starved_first(ordered: list[Req], timeout_s: float) -> list[Req]:
    """Move requests that have waited longer than ``timeout_s`` to the front, oldest first."""
    now = time.monotonic()
    starved = sorted((r for r in ordered if now - r.arrival > timeout_s), key=lambda r: r.arrival)
    if not starved:
        return ordered
    chosen = {id(r) for r in starved}
    return starved + [r for r in ordered if id(r) not in chosen]
