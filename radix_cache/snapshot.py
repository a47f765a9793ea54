"""Read-only views of a RadixCache for observers (the live dashboard, ``/cache_tree``).

Every function here reads the tree without changing it (no split, no access recorded) and does
work bounded by what it returns, never by the size of the tree: ``snapshot_tree`` ranks
subtrees by the ``subtree_tokens`` the tree keeps up to date, so a snapshot of a few hundred
nodes costs the same on a tree of a thousand nodes or of a million.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from radix_cache.node import (
    KEY_DTYPE,
    TokensLike,
    TreeNode,
    as_token_array,
    matching_child,
)
from radix_cache.views import NodeView, pack_views, unpack_views

if TYPE_CHECKING:
    from radix_cache.tree import CacheStats, RadixCache

__all__ = [
    "NodeView",
    "TreeSnapshot",
    "cached_path",
    "pack_views",
    "path_tokens",
    "snapshot_tree",
    "unpack_views",
]

_NO_TOKENS = np.empty(0, dtype=KEY_DTYPE)

# Children of one node looked at by a snapshot (the most recently added first); the rest are
# folded without being touched.
FANOUT_SCAN = 64


class TreeSnapshot(NamedTuple):
    """``nodes`` in depth-first order, each node's shown children heaviest first, and
    ``tree_nodes`` the TreeNodes they show (same order; for the tree's owner, not to be sent
    anywhere); ``stats`` and ``clock`` read at the same moment; ``scanned`` nodes were looked
    at to choose them; ``namespaces`` maps the uid of each root shown to its namespace;
    ``folded_roots`` namespace roots (cache salts) were not shown, holding
    ``folded_root_tokens`` tokens: no shown node folds them."""

    nodes: list[NodeView]
    tree_nodes: list[TreeNode]
    stats: CacheStats
    clock: int
    scanned: int
    namespaces: dict[int, Hashable]
    folded_roots: int = 0
    folded_root_tokens: int = 0


def snapshot_tree(
    cache: RadixCache,
    max_nodes: int,
    head_tokens: int = 32,
    tail_tokens: int = 8,
    scan_budget: int | None = None,
) -> TreeSnapshot:
    """The top of the tree by cached tokens: at most ``max_nodes`` nodes (namespace roots
    included), chosen best-first by subtree size, so every chosen node's parent is chosen too
    and the rest of the tree is folded into the counts of the chosen nodes.

    Work: at most ``scan_budget`` (default ``2 * max_nodes + FANOUT_SCAN``) nodes are looked
    at besides the roots. A node's children are looked at in batches of FANOUT_SCAN, most
    recently added first; a batch not yet looked at ranks by the mean subtree size of the
    children left (so a node with thousands of children does not use up the budget alone).
    Raises ValueError unless ``max_nodes >= 1``.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, got {max_nodes}")
    budget = 2 * max_nodes + FANOUT_SCAN if scan_budget is None else scan_budget
    scanned = 0
    # Entries (-priority, order, node, prefix_len, offset, tokens_seen): offset -1 offers the
    # node itself; offset >= 0 offers its children from that one on (most recent first), whose
    # earlier siblings' subtrees hold tokens_seen tokens. ``order`` breaks ties, first come
    # first.
    heap: list[tuple[float, int, TreeNode, int, int, int]] = [
        (-root.subtree_tokens, i, root, 0, -1, 0) for i, root in enumerate(cache._roots.values())
    ]
    heapq.heapify(heap)
    order = len(heap)
    chosen: list[tuple[TreeNode, int]] = []
    while heap and len(chosen) < max_nodes:
        _, _, node, prefix, offset, seen = heapq.heappop(heap)
        if offset < 0:
            chosen.append((node, prefix))
            offset = 0
        children = node.children
        take = min(len(children) - offset, FANOUT_SCAN, budget - scanned)
        if take <= 0:
            continue
        scanned += take
        below = prefix + node.key.size
        for child in islice(reversed(children.values()), offset, offset + take):
            heapq.heappush(heap, (-child.subtree_tokens, order, child, below, -1, 0))
            seen += child.subtree_tokens
            order += 1
        left = len(children) - offset - take
        if left:
            mean = (node.subtree_tokens - node.key.size - seen) / left
            heapq.heappush(heap, (-mean, order, node, prefix, offset + take, seen))
            order += 1
    views, nodes = _views(chosen, head_tokens, tail_tokens)
    shown_roots = {node.uid for node, _ in chosen if node.parent is None}
    namespaces = {r.uid: ns for ns, r in cache._roots.items() if r.uid in shown_roots}
    unshown = [r for r in cache._roots.values() if r.uid not in shown_roots]
    return TreeSnapshot(
        views,
        nodes,
        cache.stats(),
        cache.clock,
        scanned,
        namespaces,
        folded_roots=len(unshown),
        folded_root_tokens=sum(root.subtree_tokens for root in unshown),
    )


def _views(
    chosen: list[tuple[TreeNode, int]], head: int, tail: int
) -> tuple[list[NodeView], list[TreeNode]]:
    """NodeViews of ``chosen`` (parents before children) in depth-first order, and their
    nodes."""
    shown: dict[int, list[TreeNode]] = {node.uid: [] for node, _ in chosen}
    prefixes = {}
    roots = []
    for node, prefix in chosen:
        prefixes[node.uid] = prefix
        parent = node.parent
        if parent is None:
            roots.append(node)
        else:
            shown[parent.uid].append(node)
    views: list[NodeView] = []
    nodes: list[TreeNode] = []
    stack = roots[::-1]
    while stack:
        node = stack.pop()
        nodes.append(node)
        uid = node.uid
        kids = shown[uid]
        kids.sort(key=_heaviest_first)
        key = node.key
        size = key.size
        parent = node.parent
        shown_tokens = 0
        for kid in kids:
            shown_tokens += kid.subtree_tokens
        if size > head + tail:
            head_ids, tail_ids = key[:head], key[size - tail :] if tail else _NO_TOKENS
        else:
            head_ids, tail_ids = key, _NO_TOKENS
        views.append(
            NodeView(
                uid,
                0 if parent is None else parent.uid,
                prefixes[uid],
                size,
                node.subtree_tokens,
                0 if parent is None else node.lock_ref,
                node.hit_count,
                node.last_access,
                len(node.children),
                len(node.children) - len(kids),
                node.subtree_tokens - size - shown_tokens,
                head_ids,
                tail_ids,
            )
        )
        stack.extend(kids[::-1])
    return views, nodes


def _heaviest_first(node: TreeNode) -> tuple[int, int]:
    return (-node.subtree_tokens, node.uid)


def cached_path(
    cache: RadixCache,
    token_ids: TokensLike,
    namespace: Hashable = None,
    start: TreeNode | None = None,
) -> tuple[list[TreeNode], int]:
    """The nodes holding the longest cached, page-aligned prefix of ``token_ids`` (root
    excluded; the last may hold tokens beyond the prefix) and the prefix's length. Read-only:
    no split, no access recorded. O(nodes on the path).

    ``start``: a node known to end a prefix of ``token_ids`` in ``namespace`` (the node a
    request locked): its path is taken by climbing to the root, without comparing tokens, and
    the walk goes on below it. Ignored once evicted, and when it is not in ``namespace``'s
    tree (the throwaway root a match in an unseen namespace returns).
    """
    key = as_token_array(token_ids)
    root = cache._roots.get(namespace)
    node = root
    path: list[TreeNode] = []
    length = 0
    if start is not None and not start.evicted:
        cursor = start
        while cursor.parent is not None:
            path.append(cursor)
            length += cursor.key.size
            cursor = cursor.parent
        if cursor is root:
            path.reverse()
            node = start
        else:
            path, length = [], 0
    page_size = cache.page_size
    while node is not None and length + page_size <= key.size:
        found = matching_child(node, key[length:], page_size)
        if found is None:
            break
        child, k = found
        path.append(child)
        length += k
        node = child if k == child.key.size else None
    return path, length


def path_tokens(node: TreeNode) -> np.ndarray:
    """The token ids from the root through ``node`` (int32): the whole prefix ``node`` ends.
    Empty for a root; raises ValueError for an evicted node (it has no path any more)."""
    if node.evicted:
        raise ValueError(f"{node!r} was evicted")
    runs = []
    while node.parent is not None:
        runs.append(node.key)
        node = node.parent
    return np.concatenate(runs[::-1]) if runs else np.empty(0, dtype=KEY_DTYPE)
