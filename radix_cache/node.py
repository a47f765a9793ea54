"""Radix tree nodes and the vectorised token-run operations on their keys."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Token ids and slot indices are stored as int32 inside the tree: 8 bytes per cached token.
KEY_DTYPE = np.int32

TokensLike = torch.Tensor | np.ndarray | Sequence[int]

# Node ids, unique for the life of the process (snapshots name nodes by them).
_node_uids = itertools.count(1)


def as_token_array(token_ids: TokensLike) -> np.ndarray:
    """1-D int32 array of token ids given as a list[int], numpy array or CPU LongTensor.

    Precondition: ids fit in int32 (every real vocabulary does). May return a view of the input.
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    elif isinstance(token_ids, list):
        return np.fromiter(token_ids, dtype=KEY_DTYPE, count=len(token_ids))
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=KEY_DTYPE)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(KEY_DTYPE, copy=False)


def child_key(tokens: np.ndarray, page_size: int) -> bytes:
    """Dict key under which a run starting with ``tokens`` hangs off its parent: its first page.

    Precondition: ``tokens.size >= page_size``.
    """
    return tokens[:page_size].tobytes()


def common_prefix_len(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (both KEY_DTYPE), rounded down
    to whole pages."""
    n = min(a.size, b.size)
    if a[:n].tobytes() == b[:n].tobytes():  # the common case on a path: one memcmp
        k = n
    else:
        k = int((a[:n] != b[:n]).argmax())  # first mismatch
    return k - k % page_size


def matching_child(node: TreeNode, rest: np.ndarray, page_size: int) -> tuple[TreeNode, int] | None:
    """The child of ``node`` that ``rest`` goes on into, and how many tokens of ``rest`` its key
    shares (whole pages); None where no child starts with ``rest``'s first page.

    Precondition: ``rest.size >= page_size``.
    """
    child = node.children.get(child_key(rest, page_size))
    if child is None:
        return None
    return child, common_prefix_len(child.key, rest, page_size)


@dataclass(eq=False, repr=False, slots=True)
class TreeNode:
    """One run of tokens in the radix tree and the KV slots that hold them.

    ``key`` holds the run's token ids and ``slots`` their KV slot indices (both int32, same
    length, a positive multiple of page_size; a root has an empty run). ``lock_ref`` counts the
    locks taken on this node or any descendant: a node with ``lock_ref > 0`` is protected, one
    with ``lock_ref == 0`` is evictable (and so is its whole subtree). ``pin_ref`` counts the
    pins (``RadixCache.pin``) on this node or a descendant; each pin is also one of the
    ``lock_ref`` locks, so a node with ``lock_ref == pin_ref > 0`` is held by pins alone and
    ``evict`` may unpin it when nothing else is left to free. ``last_access``,
    ``hit_count`` and ``created_at`` are logical-clock readings that eviction policies rank by.
    ``heap_stamp`` identifies the node's live entry in the eviction queue (0: none).
    ``tenant`` is who owns the node's namespace (its root's, ``RadixCache(tenant_of=...)``).
    ``subtree_tokens`` is the number of tokens in this node and all its descendants (the tree
    keeps it up to date, so snapshots can rank subtrees without walking them); ``uid`` names
    the node for its lifetime (a split keeps it on the tail, the part that keeps the node).
    """

    key: np.ndarray
    slots: np.ndarray
    parent: TreeNode | None
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    pin_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    created_at: int = 0
    heap_stamp: int = 0
    tenant: Hashable = None
    evicted: bool = False
    subtree_tokens: int = field(init=False)
    uid: int = field(init=False, default_factory=lambda: next(_node_uids))

    def __post_init__(self) -> None:
        self.subtree_tokens = self.key.size

    @classmethod
    def new_root(cls, tenant: Hashable = None) -> TreeNode:
        """A root of ``tenant``'s namespace: empty run, permanently locked so it is never
        evicted."""
        root = cls(np.empty(0, dtype=KEY_DTYPE), np.empty(0, dtype=KEY_DTYPE), None)
        root.lock_ref, root.tenant = 1, tenant
        return root

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.evicted

    @property
    def is_evictable_leaf(self) -> bool:
        return self.lock_ref == 0 and not self.children and not self.evicted

    def __repr__(self) -> str:
        head = self.key[:4].tolist()
        return (
            f"TreeNode(len={self.key.size}, key={head}{'...' if self.key.size > 4 else ''}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )
