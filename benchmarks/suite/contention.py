"""How much of the machine other processes took while a system ran: on a shared CPU a
baseline slowed down by someone else's job must be visible in the table, not hidden in it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.suite.trace import SystemRun


@dataclass(frozen=True)
class CpuSample:
    """Machine-wide busy CPU seconds (all cores, from /proc/stat; None where it cannot be
    read), this process's CPU seconds (all its threads), and a wall clock."""

    machine_busy_s: float | None
    process_s: float
    wall_s: float


def sample(pids: tuple[int, ...] = ()) -> CpuSample:
    """Now; ``pids`` are other processes of ours (a server's) whose CPU counts as ours, as do
    this process's descendants (an in-process engine's grammar worker)."""
    ours = time.process_time() + sum(_process_cpu_s(p) for p in {*pids, *_descendants()})
    return CpuSample(_machine_busy_s(), ours, time.perf_counter())


def _descendants() -> set[int]:
    """The live descendants of this process (from /proc; empty where it cannot be read)."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found: set[int] = set()
    frontier = [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier += children
    return found


def others_share(start: CpuSample, end: CpuSample) -> float | None:
    """The fraction of the machine's CPU capacity (cores x wall time) that other processes
    used between two samples: (machine busy - ours) / (cores x wall), clamped to [0, 1]."""
    if start.machine_busy_s is None or end.machine_busy_s is None:
        return None
    wall = end.wall_s - start.wall_s
    if wall <= 0:
        return None
    others = (end.machine_busy_s - start.machine_busy_s) - (end.process_s - start.process_s)
    return min(max(others / (wall * (os.cpu_count() or 1)), 0.0), 1.0)


def _machine_busy_s() -> float | None:
    """user + nice + system + irq + softirq + steal, summed over cores, in seconds."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measured(run: Callable[[], SystemRun]) -> SystemRun:
    """``run()``, with the share of the CPU other processes used meanwhile recorded on it."""
    start = sample()
    result = run()
    result.other_cpu_share = others_share(start, sample())
    return result


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a process from /proc/PID/stat, in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            after_name = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")
