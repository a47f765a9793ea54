"""Exceptions a request's caller sees."""

from __future__ import annotations


class RequestError(ValueError):
    """The runtime refused or could not finish a request; ``status_code`` is its HTTP status,
    ``param`` the sampling parameter it is about (None: the request as a whole)."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param


class SchedulerDied(RuntimeError):
    """The scheduler stopped; no request can complete."""


class ModelLoadError(ValueError):
    """A model path that cannot be served: missing, corrupt, truncated, or in a format,
    architecture or tensor type this runtime does not load. The message names the file and
    the problem in one line."""
