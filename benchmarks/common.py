"""Shared benchmark plumbing: timing, tables, JSON results."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).parent / "results"
# Plain English prose (written for the project, ~840 tokens for SmolLM2's tokenizer): real text
# for real models, where random token ids would test nothing a user sends.
ENGLISH_PASSAGE = Path(__file__).parent / "data" / "english_passage.txt"


def best_time(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Seconds of the fastest of ``repeat`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timed_into(fn: Callable[..., Any], clock: list[float]) -> Callable[..., Any]:
    """``fn``, adding the wall time of each call to ``clock[0]`` (to time one kind of op
    inside a larger run: attention, collectives)."""

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            clock[0] += time.perf_counter() - start

    return timed


# The CPU flags a kernel dispatches on, in the order ``cpu_description`` names them.
_NAMED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_description() -> str:
    """The CPU as a benchmark row names it: model, the dispatch flags it has, L2 and L3, cores
    (from /proc/cpuinfo and lscpu; what it cannot read it leaves out)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    caches = []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("L2 cache", "L3 cache"):
                caches.append(f"{name.split()[0]} {value.split('(')[0].strip()}")
    except (OSError, subprocess.SubprocessError):
        pass
    has = [flag for flag in _NAMED_FLAGS if flag in flags]
    cores = f"{torch.get_num_threads()} threads"
    return ", ".join([model, " ".join(has) or "no AVX2", *caches, cores])


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu": cpu_description(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def write_json(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
