"""Every triton kernel compiles for sm_90 (H100) without a GPU, in a process where
TRITON_INTERPRET is unset (this one has it set, so its kernels are interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_compile_for_sm90() -> None:
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    if not Path(nvidia.get_ptxas(90).path).exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, str(HERE / "gpu_compile.py"), "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The bf16 paths are the ones users run on GPUs: they must not spill registers.
    bf16_lines = [line for line in result.stdout.splitlines() if " bf16" in line]
    assert bf16_lines
    assert all(", 0 B spilled" in line for line in bf16_lines), "\n".join(bf16_lines)
