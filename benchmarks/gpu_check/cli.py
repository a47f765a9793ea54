"""The command: check the environment, run each section in its own process within the time
budget, write the JSON, print the markdown, and exit non-zero when a gating check failed."""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.checks import ERROR, SKIPPED, Check, Deadline

ROOT = Path(__file__).resolve().parents[2]
RESERVE_S = 10.0  # kept back from the budget for writing the results
NO_CUDA = (
    "benchmarks.gpu_check: no CUDA device (torch {torch} reports none). Run it on a GPU machine "
    "(`bash benchmarks/gpu_check.sh`; docs/benchmarks.md says how), or pass --cpu-smoke to "
    "check the harness itself on CPU."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description="One-command GPU validation: triton kernels against the torch references, "
        "Engine greedy tokens on CUDA against CPU float32, CUDA graphs against eager, kernel "
        "and Engine throughput.",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="stop starting sections when this runs low (default 540)",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the same harness on CPU at tiny sizes, triton interpreted",
    )
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated sections to run, the rest reported skipped (a short re-run)",
    )
    # The child side: one section in this process.
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--time-left", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Decided before anything imports triton: interpreted on CPU, compiled on a GPU.
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    if args.section:
        return _child(args)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__), file=sys.stderr)
        return 2
    return _parent(args)


def _child(args: argparse.Namespace) -> int:
    from benchmarks.gpu_check.sections import run_section

    result = run_section(args.section, args.cpu_smoke, args.time_left)
    Path(args.result).write_text(json.dumps(result))
    return 0


def _parent(args: argparse.Namespace) -> int:
    from benchmarks.common import write_json
    from benchmarks.gpu_check.environment import describe
    from benchmarks.gpu_check.report import failed_checks, markdown
    from benchmarks.gpu_check.sections import SECTIONS

    smoke = args.cpu_smoke
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {section.name for section in SECTIONS}
    if unknown:
        print(f"--only: no section {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    budget = Deadline(args.budget_s)
    started = time.monotonic()
    environment = describe(cuda=not smoke)
    print(f"benchmarks.gpu_check: {environment}", flush=True)
    sections: list[dict[str, Any]] = []
    for section in SECTIONS:
        if smoke and section.gpu_only:
            sections.append(_skipped(section.name, "skipped in --cpu-smoke"))
            continue
        if only is not None and section.name not in only:
            sections.append(_skipped(section.name, "not in --only"))
            continue
        left = budget.left() - RESERVE_S
        if left < section.need(smoke):
            detail = f"budget: {left:.0f} s left, needs about {section.need(smoke):.0f} s"
            sections.append(_skipped(section.name, detail))
            continue
        timeout = min(section.cap(smoke), left)
        print(f"\n== {section.name} (at most {timeout:.0f} s)", flush=True)
        sections.append(_run_child(section.name, section.gating, smoke, timeout))
        for check in sections[-1]["checks"]:
            print(f"   {check['status']:7} {check['name']}: {check['detail']}", flush=True)
    payload: dict[str, Any] = {
        "mode": "cpu-smoke" if smoke else "cuda",
        "date": datetime.date.today().isoformat(),
        "environment": environment,
        "budget_s": args.budget_s,
        "elapsed_s": time.monotonic() - started,
        "sections": sections,
    }
    payload["failed"] = failed_checks(sections)
    payload["passed"] = not payload["failed"]
    write_json("gpu_check-cpu-smoke" if smoke else "gpu_check", payload, args.out)
    print("\n" + markdown(payload))
    return 0 if payload["passed"] else 1


def _skipped(name: str, detail: str) -> dict[str, Any]:
    return {"name": name, "status": SKIPPED, "detail": detail, "elapsed_s": 0.0, "checks": [],
            "tables": {}}  # fmt: skip


def _run_child(name: str, gating: bool, smoke: bool, timeout: float) -> dict[str, Any]:
    """Run one section in a child process, its output passed through; a timeout or a crash
    becomes one error check carrying the end of the child's output."""
    env = dict(os.environ)
    env |= {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        result_path = Path(tmp) / "result.json"
        command = [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--section",
            name,
            "--result",
            str(result_path),
            "--time-left",
            f"{max(timeout - 5, 1):.0f}",
        ]
        command += ["--cpu-smoke"] if smoke else []
        start = time.monotonic()
        returncode, tail = _stream(command, env, timeout)
        elapsed = time.monotonic() - start
        if returncode is None:
            status, detail = "timeout", f"killed after {timeout:.0f} s"
        elif result_path.exists():
            result = json.loads(result_path.read_text())
            return {"name": name, "status": "ran", "detail": "", "elapsed_s": elapsed, **result}
        else:
            status, detail = "crashed", f"exit code {returncode}"
    last = next((line for line in reversed(tail) if line.strip()), "")
    check = Check(name, ERROR, f"{detail}: {last.strip()}" if last else detail, gating)
    return {"name": name, "status": status, "detail": detail, "elapsed_s": elapsed,
            "checks": [check.to_json()], "tables": {}, "log_tail": list(tail)}  # fmt: skip


def _stream(
    command: list[str], env: dict[str, str], timeout: float
) -> tuple[int | None, collections.deque[str]]:
    """Run ``command`` in its own process group, echoing its output; (exit code or None when
    it ran out of time and was killed, its last 40 output lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None

    def echo(stream: Any) -> None:
        for line in stream:
            tail.append(line.rstrip("\n"))
            print(f"   | {line}", end="", flush=True)

    reader = threading.Thread(target=echo, args=(process.stdout,), daemon=True)
    reader.start()
    try:
        returncode: int | None = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the section's own process group only
        process.wait()
        returncode = None
    reader.join(timeout=5)
    return returncode, tail
