"""Arbor runtime: models, KV memory, scheduler, engine and server."""

from runtime.engine import Engine
from runtime.errors import RequestError, SchedulerDied
from runtime.sampling_params import InvalidSamplingParams, SamplingParams
from runtime.server_args import ServerArgs

__all__ = [
    "Engine",
    "InvalidSamplingParams",
    "RequestError",
    "SamplingParams",
    "SchedulerDied",
    "ServerArgs",
]
