"""The machine the checks ran on, and whether every package Arbor imports is importable there."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import subprocess
from typing import Any

import torch

from benchmarks.gpu_check.checks import FAIL, PASS, Check

# Every third-party module Arbor's packages import, by the distribution that provides it. A
# lent GPU machine lacks some of them (see `make gpu-wheels`); the check names the missing ones.
REQUIRED_MODULES = {
    "torch": "torch",
    "triton": "triton",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "transformers": "transformers",
    "jinja2": "jinja2",
    "tqdm": "tqdm",
    "httpx": "httpx",
    "uvloop": "uvloop",
    "xgrammar": "xgrammar",
    "interegular": "interegular",
    "jsonschema": "jsonschema",
    "pydantic": "pydantic",
    "fastapi": "fastapi",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "zmq": "pyzmq",
    "openai": "openai",
    "gguf": "gguf",
    "yaml": "pyyaml",
}
# Arbor's own entry points: importing them catches a third-party import missing from the list
# above (frontend_lang imports openai; the server imports fastapi and uvicorn).
ARBOR_MODULES = (
    "runtime.cli",
    "runtime.server",
    "runtime.gguf",
    "frontend_lang",
    "grammar",
    "benchmarks.suite",
)


def describe(cuda: bool) -> dict[str, Any]:
    """Versions of Python, torch, CUDA, triton and transformers, and the GPU's properties."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "xgrammar": _version("xgrammar"),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _driver_version(),
        }
    return info


def import_check() -> Check:
    """Import every module in REQUIRED_MODULES; fail naming each one that does not import."""
    missing = []
    for module, distribution in REQUIRED_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a package that breaks while importing
            missing.append(f"{distribution} ({type(exc).__name__}: {exc})")
    for module in ARBOR_MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:
            missing.append(f"arbor's {module} ({type(exc).__name__}: {exc})")
    if not missing:
        count = len(REQUIRED_MODULES)
        return Check("python packages", PASS, f"all {count} importable, and Arbor's entry points")
    detail = (
        f"not importable: {'; '.join(missing)}. Bring them as wheels: `make gpu-wheels` on a "
        "machine with pip access, carry .whl/, run `bash benchmarks/gpu_check.sh`"
    )
    return Check("python packages", FAIL, detail, metrics={"missing": missing})


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # the import check reports it
        return None


def _driver_version() -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip().splitlines()[0] if result.stdout.strip() else None
