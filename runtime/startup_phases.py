"""How long each phase of a server's start took, for one line per phase in the server log.

Each process times its own phases (the scheduler: kernels, model, cache pool, grammar backend;
the server process: the warm-up and the tool calibration); the scheduler's travel to the server
process in its ready message's ``server_info["startup_phases"]``, and the server process logs
them all, then the total, once it says ready.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator


class StartupPhases:
    """Named phases with their wall seconds, in the order they ended."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._lap_start = time.perf_counter()

    def lap(self, name: str) -> None:
        """Record phase ``name`` as the time since the previous lap (or phase, or creation)."""
        now = time.perf_counter()
        self.phases.append((name, now - self._lap_start))
        self._lap_start = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name`` (recorded even when it raises)."""
        self._lap_start = time.perf_counter()
        try:
            yield
        finally:
            self.lap(name)

    def extend(self, phases: Iterable[tuple[str, float]]) -> None:
        self.phases.extend((str(name), float(seconds)) for name, seconds in phases)

    def to_list(self) -> list[list[str | float]]:
        """As JSON-like rows ``[name, seconds]`` (what ``server_info`` carries)."""
        return [[name, seconds] for name, seconds in self.phases]


def log_startup(logger: logging.Logger, phases: Iterable[tuple[str, float]], total: float) -> None:
    """One ``startup:`` line per phase, then the total (wall seconds from the launch to ready;
    the scheduler's phases overlap the server process's own start, so they need not add up)."""
    for name, seconds in phases:
        logger.info("startup: %-30s %7.2f s", name, seconds)
    logger.info("startup: %-30s %7.2f s", "total", total)
