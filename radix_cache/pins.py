"""The radix cache's pins: which nodes are pinned, in what order, and until when.

A pin keeps the path of a cached prefix from eviction for a while (a conversation whose turn
ended in a tool call, a prompt the client marked for caching). The tree holds the node-level
counts (``TreeNode.pin_ref``) and the sizes; this table only remembers each pin's node, its
expiry time and its age, so the tree can drop expired pins and the oldest pins first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from radix_cache.node import TreeNode


class PinTable:
    """One entry per pinned node: its expiry time (seconds, the caller's clock).

    Entries are kept oldest first, where re-pinning a node makes its pin the newest. Expired
    entries are found through a min-heap of expiry times with lazy deletion (an entry whose
    time no longer matches the node's current expiry is stale and skipped).
    """

    def __init__(self) -> None:
        self._expiry: OrderedDict[TreeNode, float] = OrderedDict()
        self._heap: list[tuple[float, int, TreeNode]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._expiry

    def nodes(self) -> list[TreeNode]:
        """The pinned nodes, oldest pin first."""
        return list(self._expiry)

    def expires_at(self, node: TreeNode) -> float:
        return self._expiry[node]

    def add(self, node: TreeNode, expires_at: float) -> bool:
        """Pin ``node`` until ``expires_at``, or extend its pin (never shortened) and make it
        the newest. Returns True when ``node`` was not pinned before."""
        old = self._expiry.pop(node, None)
        if old is not None and old >= expires_at:
            expires_at = old
        self._expiry[node] = expires_at
        if old != expires_at:
            heapq.heappush(self._heap, (expires_at, next(self._seq), node))
        return old is None

    def pop_expired(self, now: float) -> list[TreeNode]:
        """Remove and return the nodes whose pin expired at or before ``now``."""
        expired = []
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, node = heapq.heappop(self._heap)
            if self._expiry.get(node) == expires_at:
                del self._expiry[node]
                expired.append(node)
        return expired

    def pop_oldest(self) -> TreeNode | None:
        """Remove and return the node of the oldest pin (None when there is none)."""
        if not self._expiry:
            return None
        node, _ = self._expiry.popitem(last=False)
        if not self._expiry:
            self._heap.clear()
        return node

    def clear(self) -> None:
        self._expiry.clear()
        self._heap.clear()
