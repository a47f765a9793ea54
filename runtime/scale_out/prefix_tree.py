"""The router's picture of one replica's cache: a radix tree of the token ids routed there.

It is approximate on purpose: it records what was *sent* to a replica (prompts, and outputs
once they finish), not what the replica's own radix cache still holds (which evicts on its own
schedule), and it is bounded by ``max_tokens`` with least-recently-used pruning of leaves. It
stores no KV, only int32 token runs, so it lives in the server process without torch.

As in the replicas' radix caches, each cache salt has a root of its own: a prefix sent under one
salt never counts as cached for another.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

_KEY = np.int32


class _Node:
    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key: np.ndarray, parent: _Node | None, stamp: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_access = stamp


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class ApproxPrefixTree:
    """Token-id prefixes with their last use, per cache salt. ``match`` finds the longest
    prefix of a query recorded under its salt; ``insert`` records a sequence; past
    ``max_tokens`` the least recently used leaves are pruned until the tree holds at most
    ``prune_to`` (90%) of it."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.prune_to = max(1, int(max_tokens * 0.9))
        self._clock = itertools.count(1)
        self.roots: dict[str | None, _Node] = {}
        self.tokens = 0
        self.pruned_tokens = 0

    def match(self, ids: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> int:
        """Length of the longest prefix of ``ids`` recorded under ``cache_salt`` (marks its
        nodes as used)."""
        query = np.asarray(ids, dtype=_KEY)
        node, done, stamp = self.roots.get(cache_salt), 0, next(self._clock)
        while node is not None and done < query.size:
            child = node.children.get(int(query[done]))
            if child is None:
                break
            common = _common(child.key, query[done:])
            child.last_access = stamp
            done += common
            if common < child.key.size:
                break
            node = child
        return done

    def insert(self, ids: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> None:
        """Record ``ids`` under ``cache_salt``; prunes when the tree outgrows ``max_tokens``."""
        query = np.array(ids, dtype=_KEY)  # a copy: the tree keeps slices of it
        stamp = next(self._clock)
        node = self.roots.get(cache_salt)
        if node is None:
            node = self.roots[cache_salt] = _Node(np.empty(0, dtype=_KEY), None, stamp)
        node.last_access = stamp
        done = 0
        while done < query.size:
            first = int(query[done])
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Node(query[done:], node, stamp)
                self.tokens += query.size - done
                break
            common = _common(child.key, query[done:])
            child.last_access = stamp
            if common < child.key.size:
                child = self._split(child, common)
            done += common
            node = child
        if self.tokens > self.max_tokens:
            self.prune(self.prune_to)

    def prune(self, target: int) -> int:
        """Drop least recently used leaves (whole or, for the last one, its tail) until at most
        ``target`` tokens remain; returns the tokens dropped."""
        dropped = 0
        while self.tokens > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last_access)
            if not leaves:
                break
            for leaf in leaves:
                excess = self.tokens - target
                if excess <= 0:
                    break
                if leaf.key.size > excess:  # keep the head of the run, drop its tail
                    leaf.key = leaf.key[: leaf.key.size - excess]
                    self.tokens -= excess
                    dropped += excess
                    break
                assert leaf.parent is not None
                del leaf.parent.children[int(leaf.key[0])]
                self.tokens -= leaf.key.size
                dropped += leaf.key.size
        # Forget salts with nothing recorded, so per-tenant roots do not pile up.
        self.roots = {salt: root for salt, root in self.roots.items() if root.children}
        self.pruned_tokens += dropped
        return dropped

    def clear(self) -> None:
        self.roots.clear()
        self.tokens = 0

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s run at ``at``; returns the new upper part (the old node hangs below)."""
        assert node.parent is not None and 0 < at < node.key.size
        upper = _Node(node.key[:at], node.parent, node.last_access)
        node.parent.children[int(node.key[0])] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[int(node.key[0])] = node
        return upper

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves
