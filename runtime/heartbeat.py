"""The scheduler's heartbeat: proof, readable from the HTTP process, that its loop still turns.

A live scheduler process is not a working one: blocked in a read that never returns, or
stopped, it stays alive while every request waits forever. So the scheduler stamps the
monotonic time (``CLOCK_MONOTONIC``, one clock for every process of the machine) at the end
of each loop iteration, idle ones included (its idle wait is bounded), into shared memory,
beside the longest forward step it has run. The server process reads them without a message
or a lock: each double is written whole, and a stale read only ages the beat by one loop.

``stalled_for`` is what /health asks: how long since the last beat, when that is past the
bound. The bound is the larger of the configured one and four times the longest forward step
seen, so a deployment whose prefill chunks legitimately take a minute does not report itself
stalled while it works, while a loop that never finishes an iteration trips it all the same.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import time
from typing import Protocol

# How many times the longest forward step seen a silence must last to count as a stall.
LONGEST_STEP_FACTOR = 4.0
_LAST_BEAT, _LONGEST_STEP = 0, 1


class _Doubles(Protocol):
    """A shared ``RawArray`` of doubles, or a plain list for a local heartbeat."""

    def __getitem__(self, index: int) -> float: ...

    def __setitem__(self, index: int, value: float) -> None: ...


class Heartbeat:
    """Two doubles: the last beat (monotonic seconds) and the longest forward step (seconds).

    ``shared()`` puts them in shared memory: create it in the parent before starting the
    scheduler process and hand it over as a ``Process`` argument. One writer (the scheduler
    thread), any number of readers."""

    def __init__(self, values: _Doubles) -> None:
        self._values = values
        self._values[_LAST_BEAT] = time.monotonic()

    @classmethod
    def shared(cls) -> Heartbeat:
        """Backed by shared memory a spawned child receives through ``Process`` arguments."""
        return cls(multiprocessing.get_context("spawn").RawArray(ctypes.c_double, 2))

    @classmethod
    def local(cls) -> Heartbeat:
        """For a scheduler nobody watches from another process (the Engine, a replica)."""
        return cls([0.0, 0.0])

    def beat(self) -> None:
        """The loop finished an iteration (or, at its start, loading is over)."""
        self._values[_LAST_BEAT] = time.monotonic()

    def observe_step(self, seconds: float) -> None:
        """A forward step took ``seconds`` (the scheduler thread only)."""
        if seconds > self._values[_LONGEST_STEP]:
            self._values[_LONGEST_STEP] = seconds

    def bound(self, configured_s: float) -> float:
        """The silence, in seconds, that counts as a stall (see the module docstring)."""
        return max(configured_s, LONGEST_STEP_FACTOR * self._values[_LONGEST_STEP])

    def stalled_for(self, configured_s: float) -> float | None:
        """Seconds since the last beat when that exceeds ``bound(configured_s)``, else None."""
        silence = time.monotonic() - self._values[_LAST_BEAT]
        return silence if silence > self.bound(configured_s) else None
