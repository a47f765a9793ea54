"""Arbor runtime: models, KV memory, scheduler, engine and server.

The names below load on first use, so ``import runtime.server_args`` (the CLI parsing flags,
the server's HTTP process) does not import torch and the scheduler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.errors import RequestError, SchedulerDied
    from runtime.sampling_params import InvalidSamplingParams, SamplingParams
    from runtime.server_args import ServerArgs

_WHERE = {
    "Engine": "runtime.engine",
    "RequestError": "runtime.errors",
    "SchedulerDied": "runtime.errors",
    "InvalidSamplingParams": "runtime.sampling_params",
    "SamplingParams": "runtime.sampling_params",
    "ServerArgs": "runtime.server_args",
}

__all__ = [
    "Engine",
    "InvalidSamplingParams",
    "RequestError",
    "SamplingParams",
    "SchedulerDied",
    "ServerArgs",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
