"""Tensor parallelism on torch.distributed: the group of ranks, which shard each rank holds,
and the worker processes that follow rank 0's steps (docs/scale-out.md).

The names below load on first use, so flag parsing can import ``partition`` (plain arithmetic)
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.distributed.group import SINGLE, TPGroup
    from runtime.distributed.leader import TensorParallelRunner, start_model_runner
    from runtime.distributed.partition import HeadPartition, Shard, check_tp_size

__all__, __getattr__ = lazy_exports(__name__)
