"""``benchmarks.gpu_check``: the CPU smoke end to end (the same harness a GPU run uses), the
comparisons that decide pass and fail, and the isolation of sections from each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.gpu_check import cli, sections
from benchmarks.gpu_check.checks import (
    ERROR,
    FAIL,
    INFO,
    PASS,
    Check,
    compare_tokens,
    first_divergence,
    tensor_error,
)
from benchmarks.gpu_check.kernel_checks import KERNEL_CHECKS, verdict
from benchmarks.gpu_check.report import failed_checks, markdown

ROOT = Path(__file__).resolve().parents[2]
SECTION_NAMES = [section.name for section in sections.SECTIONS]


def _gpu_check(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cpu_smoke_runs_every_section_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    start = time.monotonic()
    result = _gpu_check("--cpu-smoke", "--budget-s", "100", "--out", str(out), timeout=110)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - start < 100
    payload = json.loads(out.read_text())
    assert payload["mode"] == "cpu-smoke" and payload["passed"] and payload["failed"] == []
    assert {"python", "torch", "triton", "transformers"} <= set(payload["environment"])
    assert [s["name"] for s in payload["sections"]] == SECTION_NAMES
    by_name = {s["name"]: s for s in payload["sections"]}
    for section in payload["sections"]:
        for check in section["checks"]:
            assert set(check) == {"name", "status", "detail", "gating", "metrics"}
    # Every kernel in both dtypes it supports, each with its measured error.
    kernel_checks = {c["name"]: c for c in by_name["kernels"]["checks"]}
    for kernel_check in KERNEL_CHECKS:
        for dtype in kernel_check.dtypes:
            check = kernel_checks[f"{kernel_check.op} {str(dtype).removeprefix('torch.')}"]
            assert check["status"] == PASS, check
            assert check["metrics"]["max_abs_err"] >= 0 and check["metrics"]["cases"]
    assert kernel_checks["every triton kernel checked"]["status"] == PASS
    engine = by_name["engine"]["checks"]
    assert [c["status"] for c in engine] == [PASS, INFO]
    assert engine[1]["metrics"]["agreement"] <= 1.0 and not engine[1]["gating"]
    gpu_only = ("kernel_bench", "engine_throughput", "formats")
    assert {by_name[name]["status"] for name in gpu_only} == {"skipped"}
    assert "| kernels | decode_attention float32 | pass |" in result.stdout
    assert "**PASS**" in result.stdout


def test_a_short_budget_skips_sections_and_still_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "short.json"
    result = _gpu_check("--cpu-smoke", "--budget-s", "12", "--out", str(out), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    skipped = [s for s in payload["sections"] if s["status"] == "skipped"]
    assert any("budget" in s["detail"] for s in skipped)
    assert [s["name"] for s in payload["sections"]] == SECTION_NAMES


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_instead_of_a_traceback() -> None:
    result = _gpu_check(timeout=60)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--cpu-smoke" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_crashing_section_is_reported_and_the_next_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The child cannot find a section of this name: it dies with a KeyError.
    broken = sections.Section("no-such-section", sections._models, (1, 1), (60, 60))
    monkeypatch.setattr(sections, "SECTIONS", (broken, sections.SECTIONS_BY_NAME["cuda_graphs"]))
    out = tmp_path / "crash.json"
    args = cli.parse_args(["--cpu-smoke", "--budget-s", "100", "--out", str(out)])
    assert cli._parent(args) == 1
    payload = json.loads(out.read_text())
    crashed, after = payload["sections"]
    assert crashed["status"] == "crashed" and crashed["checks"][0]["status"] == ERROR
    assert "KeyError" in crashed["checks"][0]["detail"]
    assert after["status"] == "ran" and after["checks"]
    assert payload["failed"] == ["no-such-section: no-such-section"]


def test_a_section_past_its_time_is_killed() -> None:
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    start = time.monotonic()
    returncode, tail = cli._stream(command, dict(os.environ), timeout=3)
    assert returncode is None and "started" in tail
    assert time.monotonic() - start < 15


def test_tensor_error_counts_what_is_out_of_tolerance() -> None:
    expected = torch.tensor([1.0, -2.0, float("-inf"), 4.0])
    assert tensor_error(expected.clone(), expected, 0.0, 0.0).ok  # equal -inf is equal
    near = expected + torch.tensor([1e-6, 0.0, 0.0, 0.0])
    assert tensor_error(near, expected, 1e-5, 0.0).ok
    off = tensor_error(expected + torch.tensor([0.0, 0.5, 0.0, 0.0]), expected, 1e-3, 1e-3)
    assert (off.mismatched, off.max_abs) == (1, pytest.approx(0.5))
    assert off.worst_share == pytest.approx(0.5 / (1e-3 + 1e-3 * 2.0))
    assert tensor_error(near, expected, 1e-5, 0.0).worst_share == pytest.approx(0.1, rel=0.1)
    unmasked = tensor_error(torch.tensor([1.0, -2.0, 3.0, 4.0]), expected, 1.0, 1.0)
    assert unmasked.mismatched == 1 and unmasked.max_abs == unmasked.worst_share == float("inf")
    with pytest.raises(ValueError, match="shape"):
        tensor_error(expected[:2], expected, 1.0, 1.0)


def test_a_nan_never_passes() -> None:
    # What a kernel that reads a poisoned (NaN) KV slot returns.
    actual = torch.tensor([[0.5, float("nan")], [0.1, 0.2]])
    error = tensor_error(actual, torch.tensor([[0.5, 0.3], [0.1, 0.2]]), 1e9, 1e9)
    assert error.mismatched == 1 and not error.ok


def test_a_broken_kernel_output_fails_its_check() -> None:
    good = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    cases = [
        ("page 1", tensor_error(good + 1e-6, good, 1e-4, 1e-4)),
        ("page 16", tensor_error(good + 1e-2, good, 1e-4, 1e-4)),
    ]
    check = verdict("decode_attention float32", cases, 1e-4)
    assert check.status == FAIL and check.failed
    assert "page 16" in check.detail and "page 1," not in check.detail
    assert check.metrics["max_abs_err"] == pytest.approx(1e-2, rel=1e-3)
    assert verdict("ok", cases[:1], 1e-4).status == PASS


def test_compare_tokens_names_the_first_divergence() -> None:
    expected = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert compare_tokens("same", [[1, 2, 3, 4], [5, 6, 7, 8]], expected).status == PASS
    check = compare_tokens("differs", [[1, 2, 3, 4], [5, 6, 9, 8]], expected)
    assert check.failed and "prompt 1, token 2: 9 (expected 7)" in check.detail
    info = compare_tokens("bf16", [[1, 2, 3, 4], [5, 6, 9, 8]], expected, gating=False)
    assert info.status == INFO and not info.failed
    assert info.metrics["agreement"] == pytest.approx(6 / 8)
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1], [1]) is None


def test_only_gating_failures_fail_the_run_and_the_markdown_says_which() -> None:
    checks: list[dict[str, Any]] = [
        Check("fp32 tokens", FAIL, "prompt 0 | token 3").to_json(),
        Check("bf16 agreement", FAIL, "reported only", gating=False).to_json(),
        Check("bitmask", PASS, "exact").to_json(),
    ]
    sections_json = [{"name": "engine", "status": "ran", "checks": checks, "tables": {
        "decode": [{"case": "B=1", "tok/s": 1234.5}]}}]  # fmt: skip
    failed = failed_checks(sections_json)
    assert failed == ["engine: fp32 tokens"]
    environment = {"python": "3.12", "torch": "2.11", "cuda": "13.0", "triton": "3.6",
                   "transformers": "5.17", "xgrammar": "0.2.8", "gpu": "NVIDIA H100",
                   "capability": "sm_90", "multiprocessors": 132, "gpu_memory_gib": 79.2,
                   "driver": "580"}  # fmt: skip
    payload = {"mode": "cuda", "date": "2026-11-24", "environment": environment,
               "budget_s": 540, "elapsed_s": 300.0, "sections": sections_json,
               "failed": failed}  # fmt: skip
    text = markdown(payload)
    assert "NVIDIA H100 (sm_90, 132 SMs" in text and "torch 2.11 (CUDA 13.0)" in text
    assert "| engine | fp32 tokens | fail | prompt 0 \\| token 3 |" in text
    assert "**FAIL**: engine: fp32 tokens" in text
    assert "| B=1 | 1,234 |" in text


def test_constrained_outputs_are_judged_only_when_finished() -> None:
    from benchmarks.gpu_check.format_checks import _schema_verdicts

    def result(text: str, reason: str) -> dict[str, object]:
        return {"text": text, "meta_info": {"finish_reason": {"type": reason}}}

    good = '{"name": "Ada", "age": 36, "job": "pilot"}'
    results = [
        result(good, "stop"),
        result('{"name": "Ada", "age": 36', "length"),  # cut: not judged
        result('{"name": "Ada", "age": 360, "job": "pilot"}', "stop"),  # out of range
        result('{"name": "Ada"', "stop"),  # finished but does not parse
    ]
    finished, valid, problems = _schema_verdicts(results)
    assert (finished, valid) == (3, 1)
    assert problems[0].startswith("prompt 2: ValidationError") and "prompt 3" in problems[1]
