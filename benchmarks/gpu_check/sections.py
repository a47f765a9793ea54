"""The sections of a run, in order, and how one runs inside its own process.

Each section runs in a child process (``python -m benchmarks.gpu_check --section NAME``) so that
a crash, a hang or a sticky CUDA error (an illegal address poisons the whole context) costs that
section only. The child writes its checks and tables as JSON for the parent to collect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_check.checks import PASS, Check, Deadline, Row, error_check

Tables = dict[str, list[Row]]
SectionRun = Callable[[bool, Deadline], tuple[list[Check], Tables]]


@dataclass(frozen=True)
class Section:
    """``need_s``: the least time left worth starting the section with; ``cap_s``: its timeout;
    both (CPU smoke, GPU). ``gating``: a crash or timeout fails the run. ``gpu_only``: skipped
    in the CPU smoke (the benchmarks; the formats check, whose GGUF and grammar compiles with
    triton interpreted would take most of the smoke's time)."""

    name: str
    run: SectionRun
    need_s: tuple[float, float]
    cap_s: tuple[float, float]
    gating: bool = True
    gpu_only: bool = False

    def need(self, smoke: bool) -> float:
        return self.need_s[0 if smoke else 1]

    def cap(self, smoke: bool) -> float:
        return self.cap_s[0 if smoke else 1]


def _environment(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    """Import every package Arbor needs (in a child: a broken binary wheel may crash it)."""
    from benchmarks.gpu_check.environment import import_check

    return [import_check()], {}


def _models(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    """Build (or find in the cache) every test model the later sections load, timing each."""
    from benchmarks.gpu_check.engine_checks import plan_for
    from benchmarks.gpu_check.speed import THROUGHPUT_MODEL
    from runtime.test_model import cached_test_model

    wanted = plan_for(smoke).models + (() if smoke else (THROUGHPUT_MODEL,))
    checks = []
    for preset, arch in wanted:
        name = f"build {preset} {arch}"
        start = time.perf_counter()
        try:
            path = cached_test_model(preset, arch)
        except Exception as exc:
            checks.append(error_check(name, exc))
            continue
        seconds = time.perf_counter() - start
        checks.append(Check(name, PASS, f"{seconds:.1f} s: {path}", metrics={"seconds": seconds}))
    return checks, {}


def _kernels(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.kernel_checks import run_kernel_checks

    return run_kernel_checks(smoke, deadline), {}


def _engine(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.engine_checks import run_engine_checks

    return run_engine_checks(smoke, deadline), {}


def _cuda_graphs(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.engine_checks import run_cuda_graph_checks

    return run_cuda_graph_checks(smoke, deadline), {}


def _formats(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.format_checks import run_format_checks

    return run_format_checks(smoke, deadline), {}


def _kernel_bench(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.speed import run_kernel_bench

    return run_kernel_bench(deadline)


def _engine_throughput(smoke: bool, deadline: Deadline) -> tuple[list[Check], Tables]:
    from benchmarks.gpu_check.speed import run_engine_throughput

    return run_engine_throughput(deadline)


# Correctness first: when the budget runs short, the benchmarks are what is left out.
SECTIONS = (
    Section("environment", _environment, need_s=(5, 10), cap_s=(60, 60)),
    Section("models", _models, need_s=(5, 20), cap_s=(60, 240)),
    Section("kernels", _kernels, need_s=(5, 30), cap_s=(90, 200)),
    Section("engine", _engine, need_s=(5, 45), cap_s=(90, 240)),
    Section("cuda_graphs", _cuda_graphs, need_s=(5, 30), cap_s=(60, 180)),
    Section("formats", _formats, need_s=(5, 30), cap_s=(90, 180), gpu_only=True),
    Section("kernel_bench", _kernel_bench, (5, 45), (60, 180), gating=False, gpu_only=True),
    Section(
        "engine_throughput", _engine_throughput, (5, 60), (60, 200), gating=False, gpu_only=True
    ),
)
SECTIONS_BY_NAME = {section.name: section for section in SECTIONS}


def run_section(name: str, smoke: bool, seconds: float) -> dict[str, Any]:
    """Run one section in this process (the child side); its checks and tables as JSON data.
    An exception that escapes the section's own per-check handling becomes one error check."""
    section = SECTIONS_BY_NAME[name]
    try:
        checks, tables = section.run(smoke, Deadline(seconds))
    except Exception as exc:
        checks, tables = [error_check(name, exc, section.gating)], {}
    return {"checks": [check.to_json() for check in checks], "tables": tables}
