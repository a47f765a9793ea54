"""Tensor parallelism on torch.distributed: the group of ranks, which shard each rank holds,
and the worker processes that follow rank 0's steps (docs/scale-out.md).

The names below load on first use, so flag parsing can import ``partition`` (plain arithmetic)
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.distributed.group import SINGLE, TPGroup
    from runtime.distributed.leader import TensorParallelRunner, start_model_runner
    from runtime.distributed.partition import HeadPartition, Shard, check_tp_size

_WHERE = {
    "SINGLE": "runtime.distributed.group",
    "TPGroup": "runtime.distributed.group",
    "TensorParallelRunner": "runtime.distributed.leader",
    "start_model_runner": "runtime.distributed.leader",
    "HeadPartition": "runtime.distributed.partition",
    "Shard": "runtime.distributed.partition",
    "check_tp_size": "runtime.distributed.partition",
}

__all__ = [
    "SINGLE",
    "HeadPartition",
    "Shard",
    "TPGroup",
    "TensorParallelRunner",
    "check_tp_size",
    "start_model_runner",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
