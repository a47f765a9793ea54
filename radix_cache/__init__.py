"""Radix-tree prefix cache over token ids with LRU eviction, lock refs and a KV slot allocator."""
