"""Shared fixtures: the locally built test models (cached under ~/.cache/arbor/models)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from runtime.server import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# KV pools start unwritten (torch.empty); in tests they start as NaN, so that reading a slot
# nothing wrote fails every time (runtime/memory_pool.py). Servers the tests start inherit it.
os.environ.setdefault("ARBOR_KV_POISON", "1")
# Under pytest-xdist (`make test` runs two workers), each worker and the servers it starts get
# their share of the cores: torch's default of a thread per core in every worker would
# oversubscribe them (set before anything imports torch).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))
if not os.path.exists("/dev/nvidia0"):
    # Without a GPU, triton kernels run under the interpreter. Set before anything imports
    # triton (transformers pulls it in through torch._dynamo during collection).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny llama-architecture test model (tokenizer adds BOS, untied head, llama3 rope)."""
    from runtime.test_model import cached_test_model

    return cached_test_model("tiny", "llama")


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_arch_model_path(request: pytest.FixtureRequest) -> Path:
    """The tiny test model in each supported architecture."""
    from runtime.test_model import cached_test_model

    return cached_test_model("tiny", request.param)


@pytest.fixture(scope="session")
def thinking_model_path() -> Path:
    """The tiny qwen3-architecture model with the qwen3 chat template: <think> and </think>
    are single tokens and the template takes ``enable_thinking``."""
    from runtime.test_model import cached_test_model

    return cached_test_model("tiny", "qwen3", chat_template="qwen3")


@pytest.fixture(scope="session")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    """One real ``arbor serve`` of the tiny model on loopback (started on first use, stopped at
    the end), shared by every directory's tests that need a plain server: each start costs
    seconds of CPU in three processes."""
    from runtime.server import ServerProcess
    from tests.server.server_process import POOL

    process = ServerProcess(tiny_model_path, *POOL)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
    assert process.process.poll() is not None
