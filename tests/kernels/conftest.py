"""Kernel tests run the triton kernels on CPU tensors under the triton interpreter.

``@triton.jit`` reads TRITON_INTERPRET when a function is defined, and triton's own library
functions (``tl.sum``, ``tl.rand``...) are defined when triton is first imported, so the
variable must be set before that import. In a full ``pytest tests`` run something else gets
there first (transformers imports torch._dynamo, which imports triton), so this conftest also
drops triton's Python modules from ``sys.modules``: the kernels' own ``import triton`` then
builds a fresh, interpreted copy. The C extension stays (it cannot load twice); modules that
imported triton earlier keep their compiled-mode copy, which nothing on CPU launches.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch


def _interpret_triton() -> None:
    imported = [name for name in sys.modules if name == "triton" or name.startswith("triton.")]
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    os.environ["TRITON_INTERPRET"] = "1"
    if imported and not interpreting:
        for name in imported:
            if not name.startswith("triton._C"):
                del sys.modules[name]


_interpret_triton()


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # The machine is shared and the interpreter is single-threaded numpy: one torch thread
    # keeps the references from competing with it.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def triton_ops() -> ModuleType:
    """The ``kernels.triton_ops`` package, its kernels running under the interpreter."""
    pytest.importorskip("triton")
    import arbor_kernels.triton_ops
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.rand, InterpretedFunction):
        pytest.fail("triton's library kernels are not interpreted; run: pytest tests/kernels")
    return arbor_kernels.triton_ops
