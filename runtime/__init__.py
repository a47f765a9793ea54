"""Arbor runtime: models, KV memory, scheduler, engine and server.

The names below load on first use, so ``import runtime.server_args`` (the CLI parsing flags,
the server's HTTP process) does not import torch and the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.errors import RequestError, SchedulerDied
    from runtime.sampling_params import InvalidSamplingParams, SamplingParams
    from runtime.server_args import ServerArgs

__all__, __getattr__ = lazy_exports(__name__)
