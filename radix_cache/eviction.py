"""Eviction policies (a small abstract base plus a registry by name) and the eviction queue."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar

from radix_cache.node import TreeNode


class EvictionPolicy(ABC):
    """Ranks evictable leaves: the leaf with the smallest ``priority`` is evicted first.

    A priority may read only the node's ``last_access``, ``hit_count`` and ``created_at``
    (logical-clock values the tree maintains). The tree re-queues a leaf whenever it changes
    those, so a policy needs no hooks of its own.
    """

    name: ClassVar[str]

    @abstractmethod
    def priority(self, node: TreeNode) -> tuple[int, ...]:
        """Sort key of ``node``; smaller goes first. Ties go to the leaf queued earliest."""


_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_eviction_policy(
    name: str,
) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator: make an EvictionPolicy subclass available as ``RadixCache(policy=name)``."""

    def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _POLICIES:
            raise ValueError(f"eviction policy {name!r} is already registered")
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return register


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Instantiate the policy registered as ``name``."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; registered: {sorted(_POLICIES)}"
        ) from None


@register_eviction_policy("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used (matched or inserted) first."""

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (node.last_access,)


@register_eviction_policy("lfu")
class LFUPolicy(EvictionPolicy):
    """Fewest hits first; least recently used among equals."""

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (node.hit_count, node.last_access)


@register_eviction_policy("fifo")
class FIFOPolicy(EvictionPolicy):
    """Oldest insertion first, however often it is used."""

    def priority(self, node: TreeNode) -> tuple[int, ...]:
        return (node.created_at,)


class EvictionQueue:
    """Min-heap of evictable leaves ordered by a policy, with lazy deletion.

    ``push(node)`` records the node's current priority and makes any older entry for it stale.
    An entry is also skipped when its node is no longer an unlocked leaf or has been evicted,
    so callers push whenever a node becomes an evictable leaf or its priority changes, and
    never have to remove anything.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple[int, ...], int, TreeNode]] = []
        self._stamps = itertools.count(1)

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        stamp = next(self._stamps)
        node.heap_stamp = stamp
        heapq.heappush(self._heap, (self.policy.priority(node), stamp, node))

    def pop(self) -> TreeNode | None:
        """Remove and return the evictable leaf of smallest priority, or None if there is none."""
        while self._heap:
            _, stamp, node = heapq.heappop(self._heap)
            if stamp == node.heap_stamp and node.is_evictable_leaf:
                node.heap_stamp = 0
                return node
        return None

    def peek_priority(self) -> tuple[int, ...] | None:
        """The priority ``pop`` would return a leaf of now (None: no leaf), dropping the stale
        entries on top."""
        while self._heap:
            priority, stamp, node = self._heap[0]
            if stamp == node.heap_stamp and node.is_evictable_leaf:
                return priority
            heapq.heappop(self._heap)
        return None

    def rebuild(self, leaves: Iterable[TreeNode]) -> None:
        """Drop every entry and queue exactly ``leaves`` (to shed stale entries)."""
        self._heap = []
        for node in leaves:
            stamp = next(self._stamps)
            node.heap_stamp = stamp
            self._heap.append((self.policy.priority(node), stamp, node))
        heapq.heapify(self._heap)

    def live_nodes(self) -> list[TreeNode]:
        """Nodes whose latest entry is still in the heap (for invariant checks)."""
        return [node for _, stamp, node in self._heap if stamp == node.heap_stamp]
