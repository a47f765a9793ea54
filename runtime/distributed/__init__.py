"""Tensor parallelism on torch.distributed: the group of ranks and which shard each rank
holds (docs/scale-out.md). The runner that drives the ranks is ``runtime/tp_runner.py``; the
worker processes that follow rank 0's steps are ``runtime/tp_worker.py``.

The names below load on first use, so flag parsing can import ``partition`` (plain arithmetic)
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.distributed.group import SINGLE, TPGroup
    from runtime.distributed.partition import HeadPartition, Shard, check_tp_size

__all__, __getattr__ = lazy_exports(__name__)
