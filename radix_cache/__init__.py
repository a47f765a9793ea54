"""Radix-tree prefix cache over token ids with LRU eviction, lock refs and a KV slot allocator.

See docs/radix_cache.md for the life of a request's KV and who frees which slots.
"""

from radix_cache.allocator import DoubleFreeError, KVSlotAllocator
from radix_cache.eviction import EvictionPolicy, make_eviction_policy, register_eviction_policy
from radix_cache.invariants import CacheInvariantError
from radix_cache.node import TreeNode
from radix_cache.tree import CacheStats, MatchResult, RadixCache

__all__ = [
    "CacheInvariantError",
    "CacheStats",
    "DoubleFreeError",
    "EvictionPolicy",
    "KVSlotAllocator",
    "MatchResult",
    "RadixCache",
    "TreeNode",
    "make_eviction_policy",
    "register_eviction_policy",
]
