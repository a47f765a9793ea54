"""Read-only views of the tree: bounded snapshots, folding, paths and prefixes, and the subtree
sizes the tree keeps for them."""

from __future__ import annotations

import numpy as np
import pytest

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.snapshot import (
    FANOUT_SCAN,
    cached_path,
    pack_views,
    path_tokens,
    snapshot_tree,
    unpack_views,
)


def make_cache(num_slots: int = 1 << 16, page_size: int = 1) -> RadixCache:
    return RadixCache(KVSlotAllocator(num_slots, page_size))


def insert(cache: RadixCache, ids: list[int] | np.ndarray) -> None:
    ids = np.asarray(ids, dtype=np.int32)
    slots = cache.allocator.alloc(ids.size)
    assert slots is not None
    cache.allocator.free(slots[: cache.insert(ids, slots)])


def random_tree(cache: RadixCache, sequences: int, seed: int = 0) -> list[np.ndarray]:
    """Sequences that each copy a random prefix of an earlier one and add new tokens."""
    rng = np.random.default_rng(seed)
    inserted = [rng.integers(1, 1000, 40, dtype=np.int32)]
    insert(cache, inserted[0])
    for _ in range(sequences):
        base = inserted[int(rng.integers(len(inserted)))]
        cut = int(rng.integers(1, base.size))
        ids = np.concatenate([base[:cut], rng.integers(1, 1000, int(rng.integers(1, 30)))])
        insert(cache, ids.astype(np.int32))
        inserted.append(ids.astype(np.int32))
    return inserted


def check_consistent(cache: RadixCache, max_nodes: int) -> None:
    """What every snapshot must satisfy, whatever the tree."""
    snap = snapshot_tree(cache, max_nodes)
    stats = cache.stats()
    views = snap.nodes
    assert len(views) <= max_nodes
    assert snap.scanned <= 2 * max_nodes + FANOUT_SCAN
    assert snap.stats == stats and snap.clock == cache.clock
    # Shown tokens plus folded tokens are every cached token: nothing lost, nothing twice.
    assert sum(v.tokens for v in views) + sum(v.folded_tokens for v in views) == stats.cached_tokens
    by_uid = {v.uid: v for v in views}
    seen: set[int] = set()
    for view, node in zip(views, snap.tree_nodes, strict=True):
        assert view.uid == node.uid and view.tokens == node.key.size
        if view.parent_uid:  # depth-first: the parent came first
            assert view.parent_uid in seen
            parent = by_uid[view.parent_uid]
            assert view.prefix_len == parent.prefix_len + parent.tokens
        seen.add(view.uid)
        shown_children = [v for v in views if v.parent_uid == view.uid]
        assert view.children == len(shown_children) + view.folded_children
        assert view.subtree_tokens == view.tokens + view.folded_tokens + sum(
            c.subtree_tokens for c in shown_children
        )


def test_subtree_sizes_follow_inserts_splits_evictions_and_reset():
    cache = make_cache(num_slots=4096)
    random_tree(cache, 200)
    cache.check_invariants()  # checks every node's subtree_tokens
    root = cache._roots[None]
    assert root.subtree_tokens == cache.total_size()
    cache.evict(cache.total_size() // 2)
    cache.check_invariants()
    assert root.subtree_tokens == cache.total_size()
    cache.reset()
    assert cache.clock == 0 and cache.stats().cached_tokens == 0


@pytest.mark.parametrize("max_nodes", [1, 2, 10, 50, 400])
def test_snapshots_are_bounded_and_fold_the_rest(max_nodes: int):
    cache = make_cache()
    random_tree(cache, 300)
    check_consistent(cache, max_nodes)
    views = snapshot_tree(cache, max_nodes).nodes
    assert len(views) == min(max_nodes, cache.stats().nodes + 1)  # + the root


def test_the_shown_nodes_are_the_heaviest():
    """Best-first by subtree size: no folded child outweighs a shown node."""
    cache = make_cache()
    random_tree(cache, 150, seed=3)
    snap = snapshot_tree(cache, 40)
    shown = {node.uid for node in snap.tree_nodes}
    lightest = min(n.subtree_tokens for n in snap.tree_nodes if n.parent is not None)
    for node in snap.tree_nodes:
        assert len(node.children) <= FANOUT_SCAN  # so every child was looked at
        for child in node.children.values():
            if child.uid not in shown:
                assert child.subtree_tokens <= lightest


def test_each_namespace_is_a_root_of_its_own_named_in_the_snapshot():
    cache = make_cache()
    ids = np.arange(1, 41, dtype=np.int32)
    for namespace in (None, "tenant-a", "tenant-b"):
        slots = cache.allocator.alloc(ids.size)
        assert slots is not None and cache.insert(ids, slots, namespace) == 0  # nothing shared
    snap = snapshot_tree(cache, 10)
    roots = [view for view in snap.nodes if view.parent_uid == 0]
    assert sorted(snap.namespaces.values(), key=str) == [None, "tenant-a", "tenant-b"]
    assert set(snap.namespaces) == {view.uid for view in roots}
    for root in roots:  # the same tokens, once under each root
        (child,) = [view for view in snap.nodes if view.parent_uid == root.uid]
        assert child.tokens == 40 and np.array_equal(child.head, ids)
    assert list(snapshot_tree(cache, 1).namespaces.values()) in ([None], ["tenant-a"], ["tenant-b"])
    assert (snap.folded_roots, snap.folded_root_tokens) == (0, 0)
    for max_nodes in (1, 2):  # roots left out: their tokens are counted apart, not lost
        small = snapshot_tree(cache, max_nodes)
        assert small.folded_roots == 3 - len(small.namespaces) >= 1
        assert small.folded_root_tokens == 40 * small.folded_roots
        counted = sum(v.tokens + v.folded_tokens for v in small.nodes) + small.folded_root_tokens
        assert counted == cache.stats().cached_tokens == 120
    check_consistent(cache, 10)


def test_a_wide_fanout_is_offered_in_batches_within_the_budget():
    cache = make_cache(num_slots=1 << 17)
    system = list(range(1, 51))
    for i in range(1000):
        insert(cache, system + [1000 + i, 5000 + i, 9000 + i])
    snap = snapshot_tree(cache, 100)
    system_view = snap.nodes[1]
    assert system_view.tokens == 50 and system_view.children == 1000
    assert len(snap.nodes) == 100  # not stuck at the first FANOUT_SCAN children
    assert system_view.folded_children == 1000 - 98
    assert snap.scanned <= 2 * 100 + FANOUT_SCAN
    check_consistent(cache, 100)


def test_views_carry_the_run_head_tail_locks_and_hits():
    cache = make_cache()
    ids = np.arange(1, 101, dtype=np.int32)
    insert(cache, ids)
    insert(cache, np.concatenate([ids[:30], np.arange(500, 510, dtype=np.int32)]))
    match = cache.match_prefix(ids)
    cache.lock(match.node)
    snap = snapshot_tree(cache, 10, head_tokens=8, tail_tokens=4)
    root, head, long_tail, short = snap.nodes
    assert (root.parent_uid, root.tokens, root.subtree_tokens) == (0, 0, 110)
    assert head.head.tolist() == list(range(1, 9)) and head.tail.tolist() == list(range(27, 31))
    assert (head.tokens, head.prefix_len, head.children) == (30, 0, 2)
    assert long_tail.prefix_len == 30 and long_tail.tokens == 70
    assert long_tail.lock_ref == 1 and head.lock_ref == 1 and short.lock_ref == 0
    assert short.head.tolist() == list(range(500, 510)) and short.tail.size == 0  # all of it
    assert long_tail.hit_count >= 2 and long_tail.last_access == cache.clock
    rows, token_ids = pack_views(snap.nodes)
    assert all(isinstance(x, int) for row in rows for x in row)  # pickles fast
    for packed, view in zip(unpack_views(rows, token_ids), snap.nodes, strict=True):
        assert packed[:-2] == view[:-2]
        assert np.array_equal(packed.head, view.head) and np.array_equal(packed.tail, view.tail)
    cache.unlock(match.node)


def test_views_change_nothing():
    cache = make_cache()
    random_tree(cache, 50)
    before = (
        cache.stats(),
        cache.clock,
        [(n.hit_count, n.last_access) for n in cache._iter_nodes()],
    )
    snapshot_tree(cache, 20)
    path, _ = cached_path(cache, list(range(1, 20)))
    for node in path:
        path_tokens(node)
    after = (
        cache.stats(),
        cache.clock,
        [(n.hit_count, n.last_access) for n in cache._iter_nodes()],
    )
    assert before == after


def test_cached_path_and_path_tokens():
    cache = make_cache()
    a = np.arange(1, 41, dtype=np.int32)
    insert(cache, a)
    insert(cache, np.concatenate([a[:25], np.arange(100, 110, dtype=np.int32)]))
    path, length = cached_path(cache, a)
    assert length == 40 and [n.key.size for n in path] == [25, 15]
    assert np.array_equal(path_tokens(path[-1]), a)
    partial, length = cached_path(cache, np.concatenate([a[:30], [7, 7]]))
    assert length == 30 and partial[-1] is path[-1]  # the last node holds more than the prefix
    assert cached_path(cache, [999])[1] == 0
    assert cached_path(cache, a, start=path[0]) == (path, 40)  # climbs from a locked node
    insert(cache, np.concatenate([a[:10], [5, 5]]))  # splits the start node: still the same
    split_path, length = cached_path(cache, a)
    assert len(split_path) == 3 and cached_path(cache, a, start=path[0]) == (split_path, 40)
    assert cached_path(cache, a, namespace="unseen") == ([], 0)
    # A request's first match in a namespace nothing was cached in locks a throwaway root;
    # once its tokens are cached, its path is found from the namespace's real root.
    throwaway = cache.match_prefix(a, namespace="new").node
    insert_in = cache.allocator.alloc(a.size)
    assert insert_in is not None and cache.insert(a, insert_in, "new") == 0
    new_path, length = cached_path(cache, a, "new", start=throwaway)
    assert length == 40 and new_path[0].parent is cache._roots["new"]
    assert cached_path(cache, a, "new", start=path[0]) == (new_path, 40)  # not its namespace
    cache.evict(cache.total_size())
    with pytest.raises(ValueError, match="evicted"):
        path_tokens(path[-1])
    assert cached_path(cache, a, start=path[0]) == ([], 0)  # an evicted start is ignored


def test_pages_and_bad_arguments():
    cache = make_cache(page_size=4)
    insert(cache, np.arange(1, 23, dtype=np.int32))  # 20 tokens in whole pages
    path, length = cached_path(cache, np.arange(1, 23, dtype=np.int32))
    assert length == 20
    check_consistent(cache, 5)
    with pytest.raises(ValueError, match="max_nodes"):
        snapshot_tree(cache, 0)
