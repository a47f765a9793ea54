"""Radix-tree prefix cache over token ids with LRU eviction, lock refs and a KV slot allocator.

See docs/radix_cache.md for the life of a request's KV and who frees which slots.

The names below load on first use (the tree and the allocator import torch), so a process that
only reads snapshots (``radix_cache.views``: the server's HTTP process) does not pay for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from radix_cache.allocator import DoubleFreeError, KVSlotAllocator
    from radix_cache.eviction import EvictionPolicy, make_eviction_policy, register_eviction_policy
    from radix_cache.invariants import CacheInvariantError
    from radix_cache.node import TreeNode
    from radix_cache.tree import CacheStats, MatchResult, RadixCache

__all__, __getattr__ = lazy_exports(__name__)
