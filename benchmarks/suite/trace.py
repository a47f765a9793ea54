"""What a benchmark run records: the calls a workload made, and when each token arrived.

Arbor runs a workload first; the calls it made (exact prompt tokens and output lengths) are
the work every baseline then replays, so every system does the same work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One model call of a workload, as Arbor made it.

    ``prompt_ids``: the exact prompt tokens. ``output_ids``: what Arbor generated; a baseline
    generates ``len(output_ids)`` tokens (0: a prefill-only scoring call, as ``select`` makes).
    ``group``: the session or program instance the call belongs to. ``wave``: the call's depth
    in its group's dependency chain (0: it waits for no other call of its group; wave w waits
    for the group's calls of waves < w), so a replay may batch calls of equal waves.
    ``constrained``: Arbor decoded it under a grammar; baselines replay it unconstrained.
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    group: int = 0
    wave: int = 0
    constrained: bool = False

    @property
    def output_len(self) -> int:
        return len(self.output_ids)


@dataclass
class Timing:
    """When one call arrived (was sent) and when each output token reached the client, in
    seconds since the run started. ``finish`` is when the call's result was complete."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: float = 0.0


@dataclass
class SystemRun:
    """One system's run of a workload: ``calls[i]`` took ``timings[i]`` and generated
    ``outputs[i]``. ``cache_hit_rate`` is prompt tokens served from a prefix cache over all
    prompt tokens (None where the system has no such cache); ``note`` says how the system was
    made comparable; ``other_cpu_share`` is the share of the machine other processes used
    during the run (see ``contention``; None when not measured)."""

    system: str
    calls: list[Call]
    timings: list[Timing]
    outputs: list[tuple[int, ...]]
    wall_s: float
    cache_hit_rate: float | None
    note: str = ""
    other_cpu_share: float | None = None


class Clock:
    """Seconds since construction (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


def assign_waves(calls: list[Call], timings: list[Timing]) -> list[Call]:
    """Calls with ``wave`` set from how they ran: within a group, a call's wave is one more
    than the highest wave among the group's calls that had finished when it was sent (0 when
    none had). Calls running side by side (fork branches) share a wave."""
    waves = [0] * len(calls)
    by_group: dict[int, list[int]] = {}
    for i in sorted(range(len(calls)), key=lambda i: timings[i].arrival):
        earlier = [
            j for j in by_group.get(calls[i].group, []) if timings[j].finish <= timings[i].arrival
        ]
        waves[i] = 1 + max((waves[j] for j in earlier), default=-1)
        by_group.setdefault(calls[i].group, []).append(i)
    return [
        Call(c.prompt_ids, c.output_ids, c.group, wave, c.constrained)
        for c, wave in zip(calls, waves, strict=True)
    ]


def replay_arrival(call: Call, group_finish: dict[tuple[int, int], float]) -> float:
    """When a replaying system may send ``call``: once every call of its group in an earlier
    wave has finished (``group_finish[(group, wave)]`` = the latest finish seen for that wave);
    0 for a group's first wave."""
    return max(
        (
            t
            for (group, wave), t in group_finish.items()
            if group == call.group and wave < call.wave
        ),
        default=0.0,
    )
