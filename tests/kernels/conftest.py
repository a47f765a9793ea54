"""Kernel tests run the triton kernels on CPU tensors under the triton interpreter.

``@triton.jit`` reads TRITON_INTERPRET when a kernel is defined, and triton's own library
kernels (``tl.rand``) are defined when triton is first imported, so the variable is set here,
before anything in this package imports triton. The ``triton_ops`` fixture checks that nothing
imported triton earlier in the process.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

_INTERPRETER_TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # The machine is shared and the interpreter is single-threaded numpy: one torch thread
    # keeps the references from competing with it.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def triton_ops() -> ModuleType:
    """The ``kernels.triton_ops`` package, its kernels running under the interpreter."""
    pytest.importorskip("triton")
    if _INTERPRETER_TOO_LATE:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; its "
            "kernels would need a GPU. Run the kernel tests in their own process: "
            "pytest tests/kernels"
        )
    import kernels.triton_ops

    return kernels.triton_ops
