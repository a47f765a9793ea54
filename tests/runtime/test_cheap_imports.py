"""Parsing flags and writing DSL programs do not pay for torch: the heavy parts load on use."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    ["runtime.server_args", "runtime.sampling_params", "runtime.generate_input", "frontend_lang"],
)
def test_importing_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_public_names_still_resolve() -> None:
    import runtime

    assert runtime.ServerArgs.__name__ == "ServerArgs"
    assert runtime.Engine.__module__ == "runtime.engine"
    with pytest.raises(AttributeError):
        runtime.NoSuchThing  # noqa: B018
