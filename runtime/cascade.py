"""Shared-prefix (cascade) decode attention: which decode requests share which prefix.

Requests that share a radix-tree prefix hold the very same KV slots for it, so sharing is read
off the request-to-slot table: two rows share positions [0, P) exactly when their first P slots
are equal. That holds for a few-shot header, a system prompt, and fork branches that diverge
mid-page alike. The decode requests of a batch are grouped by their first slot; in each group
the prefix length P is chosen to maximise the K/V reads saved, ``(sharers - 1) * P``, and
members that share less than P with the group's leader take the plain path.

The attention layer then computes, per layer, each sharer's attention over its own suffix
[P, seq_len), all sharers' attention over their common prefix in one batched pass that reads
the prefix K/V once per block of sharers (``kernels.shared_prefix_attention``), and merges the
two by log-sum-exp. The result equals plain decode attention (to float rounding).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

# Below this many shared tokens the extra pass and merge cost more than the reads they save
# (measured on the `small` model; see docs/kernels.md).
DEFAULT_MIN_PREFIX = 32


@dataclass(frozen=True)
class CascadePlan:
    """Indices count decode requests from 0 (the decode part of a batch)."""

    sharers: torch.Tensor  # [N] int64 decode indices, grouped: group g is offsets[g]..[g+1]
    sharer_offsets: torch.Tensor  # [G + 1] int64
    prefix_rows: torch.Tensor  # [G] int64 req_to_token row holding each group's prefix
    prefix_lens: torch.Tensor  # [G] int64 shared tokens per group
    kv_start: torch.Tensor  # [B_decode] int64: a sharer's prefix length, 0 for the rest

    @property
    def num_groups(self) -> int:
        return int(self.prefix_rows.numel())


def plan_cascade(
    req_to_token: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    min_prefix: int = DEFAULT_MIN_PREFIX,
) -> CascadePlan | None:
    """Group decode requests (table rows ``rows``, lengths ``seq_lens`` including the new token)
    by shared prefix; None when no group of two or more shares ``min_prefix`` tokens."""
    by_first: dict[int, list[int]] = defaultdict(list)
    firsts = req_to_token[torch.tensor(rows, dtype=torch.int64), 0].tolist()
    for b, slot in enumerate(firsts):
        if seq_lens[b] - 1 >= min_prefix:  # the new token is never shared
            by_first[slot].append(b)
    sharers: list[int] = []
    offsets, prefix_rows, prefix_lens = [0], [], []
    kv_start = [0] * len(rows)
    for members in by_first.values():
        if len(members) < 2:
            continue
        chosen, prefix = _best_prefix(req_to_token, rows, seq_lens, members, min_prefix)
        if prefix == 0:
            continue
        sharers += chosen
        for b in chosen:
            kv_start[b] = prefix
        offsets.append(len(sharers))
        prefix_rows.append(rows[chosen[0]])
        prefix_lens.append(prefix)
    if not prefix_rows:
        return None
    return CascadePlan(
        sharers=torch.tensor(sharers, dtype=torch.int64),
        sharer_offsets=torch.tensor(offsets, dtype=torch.int64),
        prefix_rows=torch.tensor(prefix_rows, dtype=torch.int64),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        kv_start=torch.tensor(kv_start, dtype=torch.int64),
    )


def _best_prefix(
    req_to_token: torch.Tensor,
    rows: list[int],
    seq_lens: list[int],
    members: list[int],
    min_prefix: int,
) -> tuple[list[int], int]:
    """(the members sharing the chosen prefix with the leader, its length; 0 if none pays)."""
    leader = members[0]
    usable = [seq_lens[b] - 1 for b in members]  # each member's own last token stays its own
    width = max(usable)
    slots = req_to_token[torch.tensor([rows[b] for b in members]), :width]  # [n, width]
    equal = (slots == slots[0]).to(torch.int32)
    common = equal.cumprod(dim=1).sum(dim=1).tolist()  # leading positions equal to the leader's
    shared = [min(c, u) for c, u in zip(common, usable, strict=True)]
    shared[0] = usable[0]
    best, best_gain = 0, 0
    for length in sorted(set(shared), reverse=True):
        if length < min_prefix:
            break
        count = sum(1 for s in shared if s >= length)
        gain = (count - 1) * length
        if count >= 2 and gain > best_gain:
            best, best_gain = length, gain
    if best == 0:
        return [], 0
    chosen = [b for b, s in zip(members, shared, strict=True) if s >= best]
    assert chosen[0] == leader
    return chosen, best
