"""Tensor parallelism end to end: an Engine with tp_size N gives the greedy tokens of tp_size 1
(fp32), holds a shard on each rank, and leaves no worker behind. Each engine here starts
worker processes (about a second each on 2 cores): keep the cases few."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from runtime import Engine, SchedulerDied
from runtime.distributed.partition import HeadPartition, check_tp_size
from runtime.test_model import cached_test_model
from tests.runtime.helpers import random_prompts
from tests.server.server_process import pid_alive

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
# A small pool and short chunks: long prompts prefill in several chunks beside running decodes.
ENGINE = {"max_total_tokens": 4096, "chunked_prefill_size": 16}


def _greedy_runs(engine: Engine) -> tuple[list[list[int]], int]:
    """Output ids of a batch of prompts (one prefilled in chunks), then of prompts that share
    their prefixes (radix cache hits); and the cached prompt tokens the second batch reused."""
    first = random_prompts([7, 40, 3], seed=5)
    second = [first[1][:30] + [11, 12], first[0] + [99]]
    outputs = [r["output_ids"] for r in engine.generate(input_ids=first, sampling_params=GREEDY)]
    results = engine.generate(input_ids=second, sampling_params=GREEDY)
    outputs += [r["output_ids"] for r in results]
    return outputs, sum(r["meta_info"]["cached_tokens"] for r in results)


@pytest.mark.parametrize(
    ("preset", "arch", "tp_size"),
    [
        ("tiny", "llama", 2),
        ("tiny", "qwen2", 2),  # q/k/v biases
        ("tiny", "qwen3", 2),  # q/k norms, head_dim != hidden / heads
        ("small", "llama", 2),
        ("small", "qwen3", 2),
        ("tiny", "llama", 4),  # 2 KV heads on 4 ranks: each replicated on two
    ],
)
def test_tp_greedy_equals_tp1_and_leaves_no_worker(preset: str, arch: str, tp_size: int) -> None:
    path = cached_test_model(preset, arch)
    with Engine(path, **ENGINE) as engine:
        expected, expected_cached = _greedy_runs(engine)
    with Engine(path, tp_size=tp_size, **ENGINE) as engine:
        info = engine.get_server_info()
        workers = info["tp_worker_pids"]
        assert info["tp_size"] == tp_size and len(workers) == tp_size - 1
        assert all(pid_alive(pid) for pid in workers)
        outputs, cached = _greedy_runs(engine)
    assert outputs == expected
    assert cached == expected_cached > 0
    assert not any(pid_alive(pid) for pid in workers)


def test_rank0_holds_its_shard_and_a_second_tp_engine_is_refused(tiny_model_path: Path) -> None:
    with Engine(tiny_model_path, tp_size=2, **ENGINE) as engine:
        runner = engine.scheduler.runner
        config = runner.config
        model = runner.model.model
        assert model.embed_tokens.weight.shape[0] == config.vocab_size // 2
        attn = model.layers[0].self_attn
        sizes = {name: size for name, (_, size) in attn.qkv_proj.shard_offsets.items()}
        d = config.head_dim
        assert sizes == {"q": config.num_heads // 2 * d, "k": d, "v": d}
        assert runner.kv_pool.k_buffers[0].shape[1] == config.num_kv_heads // 2
        assert model.layers[0].mlp.down_proj.in_shard.size == config.intermediate_size // 2
        # One tensor-parallel group per process: a second engine is refused, the first goes on.
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            Engine(tiny_model_path, tp_size=2, **ENGINE)
        assert len(engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]) == 10


def test_a_killed_rank_fails_the_engine_with_an_error_naming_it(tiny_model_path: Path) -> None:
    with Engine(tiny_model_path, tp_size=2, **ENGINE) as engine:
        (worker,) = engine.get_server_info()["tp_worker_pids"]
        os.kill(worker, signal.SIGKILL)
        while pid_alive(worker):
            time.sleep(0.05)
        with pytest.raises(SchedulerDied, match="tensor-parallel rank 1 exited with code -9"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)


def test_an_unsplittable_tp_size_is_refused_naming_the_head_counts(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4, num_key_value_heads=2"):
        Engine(tiny_model_path, tp_size=3)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        Engine(tiny_model_path, tp_size=0)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 4), (4, 2), (14, 2), (8, 8), (6, 1)])
def test_each_rank_reads_only_its_kv_heads_and_all_query_heads_are_covered(
    heads: int, kv_heads: int
) -> None:
    for tp_size in range(1, heads + 1):
        try:
            check_tp_size(tp_size, heads, kv_heads, 64 * 3 * 5 * 7)
        except ValueError:
            assert heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads)
            continue
        covered: list[int] = []
        group = heads // kv_heads
        for rank in range(tp_size):
            part = HeadPartition.of_rank(heads, kv_heads, rank, tp_size)
            q_heads = range(part.q_start, part.q_start + part.num_heads)
            kv_range = range(part.kv_start, part.kv_start + part.num_kv_heads)
            # Local query head i reads local KV head i // (local heads per local KV head).
            per_kv = part.num_heads // part.num_kv_heads
            for i, h in enumerate(q_heads):
                assert h // group == kv_range[i // per_kv]
            covered += q_heads
        assert covered == list(range(heads))
