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


def program_aware(ordered: list[Req], kv: KVCacheManager) -> list[Req]:
    """Program-aware order (compiled DSL programs, ``runtime/program``), applied to a policy's
    order: the requests of one fork (``ProgramStep.group``) move up to their first member, so
    the branches are admitted together; and when the queue's prompts need more KV than is free
    or evictable, requests continuing a program that holds pinned KV go first (finishing
    running programs before starting new ones). Otherwise the order is the policy's."""
    if not any(r.program is not None for r in ordered):
        return ordered
    groups: dict[str, list[Req]] = defaultdict(list)
    for req in ordered:
        if req.program is not None and req.program.group is not None:
            groups[req.program.group].append(req)
    result: list[Req] = []
    placed: set[int] = set()
    for req in ordered:
        if id(req) in placed:
            continue
        group = req.program.group if req.program is not None else None
        members = groups[group] if group is not None else [req]
        result.extend(members)
        placed.update(id(m) for m in members)
    if sum(r.pending_len for r in result) > kv.available_tokens():
        continuing = [r for r in result if _continues_program(r, kv)]
        if continuing:
            chosen = {id(r) for r in continuing}
            result = continuing + [r for r in result if id(r) not in chosen]
    return result


def _continues_program(req: Req, kv: KVCacheManager) -> bool:
    step = req.program
    return step is not None and kv.pins.get(step.program, step.continue_from) is not None


def with_starved_first(ordered: list[Req], timeout_s: float) -> list[Req]:
    """Move requests that have waited longer than ``timeout_s`` to the front, oldest first."""
    now = time.monotonic()
    starved = sorted((r for r in ordered if now - r.arrival > timeout_s), key=lambda r: r.arrival)
    if not starved:
        return ordered
    chosen = {id(r) for r in starved}
    return starved + [r for r in ordered if id(r) not in chosen]
