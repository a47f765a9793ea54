"""The KV pool's size at the defaults (runtime/kv_budget.py), the refusal of a size this
machine cannot hold, and a pool that takes memory as it fills, not at start."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import kv_budget
from runtime.kv_budget import (
    DEFAULT_CPU_KV_BYTES,
    KVMemoryError,
    check_kv_fits,
    check_pool_fits,
    default_cpu_kv_slots,
)
from runtime.memory_pool import PADDING_SLOT, KVPool
from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.server_args import ServerArgs

SMOLLM2_FP32 = 30 * 3 * 64 * 2 * 4  # bytes of K/V per token: 30 layers, 3 KV heads of 64
GB = 10**9


# ---- the default pool's size ---------------------------------------------------------------


def test_default_pool_holds_every_row_at_full_context_when_that_is_under_the_cap() -> None:
    slots = default_cpu_kv_slots(4, 256, SMOLLM2_FP32, page_size=1)
    assert slots == 4 * 256 + 1  # and the padding page
    assert default_cpu_kv_slots(4, 256, SMOLLM2_FP32, page_size=16) == 4 * 256 + 16


def test_default_pool_is_capped_at_one_gib_of_kv() -> None:
    slots = default_cpu_kv_slots(128, 8192, SMOLLM2_FP32, page_size=16)  # 48 GB uncapped
    usable = slots - 16
    assert usable % 16 == 0
    assert usable * SMOLLM2_FP32 <= DEFAULT_CPU_KV_BYTES < (usable + 16) * SMOLLM2_FP32
    assert DEFAULT_CPU_KV_BYTES == 1 << 30 and usable == 23_296


def test_tensor_parallel_ranks_share_the_cap() -> None:
    one = default_cpu_kv_slots(128, 8192, SMOLLM2_FP32, 1) - 1
    per_rank = SMOLLM2_FP32 // 2  # each of 2 ranks holds half the KV heads' bytes
    assert default_cpu_kv_slots(128, 8192, per_rank, 1, ranks=2) - 1 == one


def test_a_default_cpu_runner_sizes_its_pool_by_rows_and_context(tiny_model_path: Path) -> None:
    runner = ModelRunner(
        RunnerConfig(str(tiny_model_path), max_requests=3, context_len=200, pack_weights=False)
    )
    assert runner.kv_slots == 3 * 200 + 1


def test_explicit_sizes_still_decide(tiny_model_path: Path) -> None:
    base = ServerArgs(model_path=str(tiny_model_path)).for_device(False)
    explicit = RunnerConfig.from_server_args(dataclasses.replace(base, max_total_tokens=300))
    assert explicit.kv_slots == 301 and explicit.mem_fraction is None
    fraction = RunnerConfig.from_server_args(dataclasses.replace(base, mem_fraction_static=0.2))
    assert fraction.kv_slots is None and fraction.mem_fraction == 0.2


# ---- sizes this machine cannot hold --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tiny_model_path: Path) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_model_path)


def _cpu_args(tiny_model_path: Path, **flags: object) -> ServerArgs:
    return ServerArgs(model_path=str(tiny_model_path), **flags).for_device(False)  # type: ignore[arg-type]


def test_max_total_tokens_beyond_available_memory_names_the_flag_and_the_memory(
    tiny_model_path: Path, tiny_config: ModelConfig
) -> None:
    per_token = kv_budget.kv_bytes_per_token(tiny_config, "fp32")
    tokens = 10 * GB // per_token
    args = _cpu_args(tiny_model_path, max_total_tokens=tokens)
    with pytest.raises(KVMemoryError) as raised:
        check_kv_fits(args, tiny_config, available=int(8.04 * GB), total=16 * GB)
    assert str(raised.value) == (
        f"--max-total-tokens {tokens} needs {tokens * per_token / GB:.1f} GB of KV memory; "
        "this machine has 8.0 GB available"
    )
    check_kv_fits(args, tiny_config, available=11 * GB, total=16 * GB)  # fits: no error


def test_a_16_bit_cache_needs_half_the_memory(
    tiny_model_path: Path, tiny_config: ModelConfig
) -> None:
    per_token = kv_budget.kv_bytes_per_token(tiny_config, "fp32")
    args = _cpu_args(tiny_model_path, max_total_tokens=GB // per_token, kv_cache_dtype="bf16")
    check_kv_fits(args, tiny_config, available=GB // 2 + 1, total=16 * GB)
    with pytest.raises(KVMemoryError):
        check_kv_fits(args, tiny_config, available=GB // 2 - per_token, total=16 * GB)


def test_mem_fraction_beyond_available_memory_names_the_flag_and_the_memory(
    tiny_model_path: Path, tiny_config: ModelConfig
) -> None:
    args = _cpu_args(tiny_model_path, mem_fraction_static=0.9)
    with pytest.raises(KVMemoryError) as raised:
        check_kv_fits(args, tiny_config, available=8 * GB, total=10 * GB)
    assert str(raised.value) == (
        "--mem-fraction-static 0.9 needs 9.0 GB for the weights and the KV pool; "
        "this machine has 8.0 GB available"
    )
    check_kv_fits(args, tiny_config, available=9 * GB, total=10 * GB)


def test_the_defaults_pass_whatever_is_available(
    tiny_model_path: Path, tiny_config: ModelConfig
) -> None:
    check_kv_fits(_cpu_args(tiny_model_path), tiny_config, available=0, total=GB)


def test_a_runner_refuses_a_pool_bigger_than_available_memory() -> None:
    with pytest.raises(KVMemoryError, match="a KV pool of 1000 tokens needs 2.0 GB"):
        check_pool_fits(1000, 2 * GB, available=GB)
    check_pool_fits(1000, GB, available=GB)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("flag", "value", "needs"),
    [("--max-total-tokens", "10000000000000", "of KV memory"), ("--mem-fraction-static", "50", "")],
)
def test_arbor_serve_exits_at_start_with_one_line(
    tiny_model_path: Path, flag: str, value: str, needs: str
) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "runtime.cli", "serve", "--model-path", str(tiny_model_path),
            "--device", "cpu", "--port", str(_free_port()), flag, value,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"arbor serve: error: {flag} {value} needs ")
    assert needs in lines[0] and lines[0].endswith(" GB available")


# ---- memory committed as the pool fills ----------------------------------------------------


def test_the_padding_slot_is_zero_and_nothing_else_is_written() -> None:
    pool = KVPool(64, 2, 2, 8, torch.float32, torch.device("cpu"))
    for buffer in pool.k_buffers + pool.v_buffers:
        assert not buffer[PADDING_SLOT].any()


_RSS_PROBE = """
import torch
from pathlib import Path
from runtime.memory_pool import KVPool

def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

before = rss_mb()
pool = KVPool(16384, 4, 4, 64, torch.float32, torch.device("cpu"))  # 128 MiB nominal
started = rss_mb()
pool.write(0, torch.arange(1, 4097), torch.ones(4096, 4, 64), torch.ones(4096, 4, 64))
written = rss_mb()
print(pool.bytes / 2**20, started - before, written - started)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
def test_a_cpu_pool_takes_memory_as_it_is_written_not_at_start() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ARBOR_KV_POISON"}  # as users run it
    done = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    nominal, at_start, after_write = (float(x) for x in done.stdout.split())
    assert nominal == 128
    assert at_start < 8  # a zero-filled pool would take all 128 MiB here
    # A quarter of layer 0's K and V: 4 MiB each, committed once written.
    assert 7 < after_write < 24
