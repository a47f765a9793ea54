"""One step's grammar masks for a batch: fill the constrained rows, apply them in one op."""

from __future__ import annotations

from collections.abc import Sequence

import arbor_kernels as kernels
import torch

from grammar.backend import GrammarBackend, GrammarMatcher, allocate_bitmask


def apply_grammar_masks(
    backend: GrammarBackend,
    logits: torch.Tensor,
    matchers: Sequence[GrammarMatcher | None],
    bitmask: torch.Tensor | None = None,
) -> None:
    """Mask logits [B, V] in place: row i by ``matchers[i]``; rows whose matcher is None
    (unconstrained requests) are untouched.

    Call after logit bias and penalties, before temperature and top-k/top-p. ``bitmask``: an
    optional reusable CPU int32 buffer with at least as many rows as constrained requests and
    ``ceil(V / 32)`` words. Preconditions: no matcher is terminated. Fills run on the CPU; the
    packed mask is copied to the logits' device and applied by ``kernels.apply_token_bitmask``.
    """
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    if bitmask is None or bitmask.shape[0] < len(rows):
        bitmask = allocate_bitmask(len(rows), logits.shape[-1])
    bitmask = bitmask[: len(rows)]
    present = [m for m in matchers if m is not None]
    backend.fill_masks(present, bitmask, list(range(len(rows))))
    apply_filled_masks(logits, bitmask, rows)


def apply_filled_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Mask ``logits`` [B, V] in place: row rows[i] by the already filled ``bitmask[i]`` (a CPU
    int32 buffer, copied to the logits' device), in one ``kernels.apply_token_bitmask``."""
    device = logits.device
    indices = torch.tensor(list(rows), device=device)
    mask = bitmask[: len(rows)].to(device, non_blocking=True)
    kernels.apply_token_bitmask(logits, mask, indices)
