"""A Prometheus histogram as a few counts: observed in one process, rendered in another.

The server process renders ``/metrics``; a histogram the scheduler process observes (the
grammar's compile times) travels in its ``server_info`` as ``to_dict`` and is rebuilt there with
``from_dict``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any


class Histogram:
    """Counts per bucket (upper bounds ``buckets``, ascending; values above the last count in
    ``+Inf`` only), their total and sum. Not thread-safe: one thread observes."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        return {
            "buckets": list(self.buckets),
            "counts": list(self.counts),
            "total": self.total,
            "sum": self.sum,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        """The histogram ``to_dict`` wrote (ValueError if the counts do not fit the buckets)."""
        histogram = cls(data["buckets"])
        if len(data["counts"]) != len(histogram.buckets):
            raise ValueError("a histogram's counts must match its buckets")
        histogram.counts = [int(count) for count in data["counts"]]
        histogram.total = int(data["total"])
        histogram.sum = float(data["sum"])
        return histogram

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {self.total}")
        return lines
