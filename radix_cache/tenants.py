"""Fair eviction between tenants: one eviction queue per tenant, and which tenant gives way.

A tenant is whoever owns a namespace (``RadixCache(tenant_of=...)`` says who; without it every
namespace is one tenant's and eviction is the policy's order over the whole tree). Each node
carries its tenant (``TreeNode.tenant``, its root's), so queueing a leaf or counting its tokens
never walks the tree.

When the pool must give up KV, the tenant holding the most cached tokens above an equal share
of the pool (the pool's capacity over the tenants that hold cache) gives up its next leaf in
policy order: a tenant flooding the server evicts itself, not the others. When no tenant over
its share has an unlocked leaf, the leaf first in policy order across all tenants goes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from radix_cache.eviction import EvictionPolicy, EvictionQueue
from radix_cache.node import TreeNode


class TenantQueues:
    """The evictable leaves of each tenant, each tenant's queue in ``policy`` order, and the
    cached tokens each tenant holds (``tokens``, kept by the tree through ``add_tokens``).

    ``capacity``: the pool's size in tokens, which the equal share divides.
    """

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self._queues: dict[Hashable, EvictionQueue] = {}
        self.tokens: dict[Hashable, int] = {}  # a tenant is listed while it holds cache

    def __len__(self) -> int:
        """Entries held in all queues, stale ones included."""
        return sum(len(queue) for queue in self._queues.values())

    def push(self, node: TreeNode) -> None:
        """Queue ``node`` (an evictable leaf, or one whose priority changed) in its tenant's
        queue; an older entry for it becomes stale (``EvictionQueue.push``)."""
        queue = self._queues.get(node.tenant)
        if queue is None:
            queue = self._queues[node.tenant] = EvictionQueue(self.policy)
        queue.push(node)

    def add_tokens(self, tenant: Hashable, tokens: int) -> None:
        """Count ``tokens`` (negative: gone) more cached for ``tenant``. A tenant left with
        none is forgotten, with its queue (whose entries can then only be stale)."""
        held = self.tokens.get(tenant, 0) + tokens
        if held:
            self.tokens[tenant] = held
        else:
            self.tokens.pop(tenant, None)
            self._queues.pop(tenant, None)

    def pop(self) -> TreeNode | None:
        """Remove and return the leaf to evict next (see the module doc), None if no tenant
        has an evictable leaf. O(tenants) besides the heap pops."""
        if len(self._queues) == 1:  # one tenant (the default): the policy's order
            return next(iter(self._queues.values())).pop()
        share = self.capacity / max(len(self.tokens), 1)
        over = [t for t, held in self.tokens.items() if held > share and t in self._queues]
        for tenant in sorted(over, key=self.tokens.__getitem__, reverse=True):
            node = self._queues[tenant].pop()
            if node is not None:
                return node
        heads = [(q.peek_priority(), t) for t, q in self._queues.items()]
        live = [(priority, t) for priority, t in heads if priority is not None]
        if not live:
            return None
        _, tenant = min(live, key=lambda head: head[0])
        return self._queues[tenant].pop()

    def rebuild(self, leaves: Iterable[TreeNode]) -> None:
        """Drop every entry and queue exactly ``leaves``, each in its tenant's queue."""
        by_tenant: dict[Hashable, list[TreeNode]] = {}
        for node in leaves:
            by_tenant.setdefault(node.tenant, []).append(node)
        for tenant, queue in self._queues.items():
            queue.rebuild(by_tenant.get(tenant, ()))

    def live_nodes(self) -> list[tuple[Hashable, TreeNode]]:
        """``(queue's tenant, node)`` for each node whose latest entry is queued (for
        invariant checks)."""
        return [(t, node) for t, q in self._queues.items() for node in q.live_nodes()]
