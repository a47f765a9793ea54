"""A cache snapshot's nodes as another process receives them: ``NodeView`` rows and their
compact wire form (``pack_views`` / ``unpack_views``).

numpy only, so that the server's HTTP process can read snapshots without importing torch
(``radix_cache.snapshot`` takes them from the tree and re-exports these names).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class NodeView(NamedTuple):
    """One node as a snapshot saw it. A namespace root has ``parent_uid`` 0 and no tokens.

    ``head`` holds the ids of the run's first tokens and ``tail`` those of its last tokens when
    the run is longer than both together (else ``tail`` is empty and ``head`` is the whole run);
    int32 arrays, read-only views of the node's run (the tree never changes a run in place).
    ``folded_children`` of the node's children are not in the snapshot; their subtrees hold
    ``folded_tokens`` tokens. ``lock_ref`` is the number of running requests pinning the node.
    """

    uid: int
    parent_uid: int
    prefix_len: int  # tokens on the path above this node
    tokens: int
    subtree_tokens: int
    lock_ref: int
    hit_count: int
    last_access: int
    children: int
    folded_children: int
    folded_tokens: int
    head: np.ndarray
    tail: np.ndarray


_NO_TOKENS = np.empty(0, dtype=np.int32)


def pack_views(views: list[NodeView]) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """``views`` in a form that pickles fast (to send them to another process): one tuple of
    ints per view, its ``head`` and ``tail`` replaced by their lengths, and all their token
    ids in one array. ``unpack_views`` undoes it."""
    rows: list[tuple[int, ...]] = [(*view[:-2], view.head.size, view.tail.size) for view in views]
    runs = [run for view in views for run in (view.head, view.tail)]
    token_ids: np.ndarray = np.concatenate(runs) if runs else _NO_TOKENS
    return rows, token_ids


def unpack_views(rows: list[tuple[int, ...]], token_ids: np.ndarray) -> list[NodeView]:
    """The views ``pack_views`` packed."""
    views = []
    offset = 0
    for row in rows:
        head, tail = row[-2:]
        runs = (token_ids[offset : offset + head], token_ids[offset + head : offset + head + tail])
        views.append(NodeView._make(row[:-2] + runs))
        offset += head + tail
    return views
