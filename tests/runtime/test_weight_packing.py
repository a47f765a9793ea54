"""Projection weights packed into oneDNN's layout on CPU float32: same logits, one copy."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.layers.basic import Linear
from runtime.model_runner import ModelRunner, RunnerConfig
from tests.runtime.paged_driver import PagedDriver


def _runner(model: Path, pack: bool, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        RunnerConfig(str(model), dtype=dtype, kv_slots=1024, max_requests=4, pack_weights=pack)
    )


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    driver = PagedDriver(runner)
    seqs = [driver.new_sequence() for _ in prompts]
    return driver.extend(seqs, prompts, logits="all")


def test_packed_weights_give_the_same_logits_and_are_held_once(tiny_arch_model_path: Path) -> None:
    plain, packed = _runner(tiny_arch_model_path, False), _runner(tiny_arch_model_path, True)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert all(m.packed is None for m in plain.model.modules() if isinstance(m, Linear))
    prompts = [[5, 17, 300, 42, 9, 1000, 77], [8, 8, 8, 2000]]
    logits = [_prefill_logits(r, prompts) for r in (plain, packed)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    greedy = [PagedDriver(r, seed=1).greedy(prompts, 12) for r in (plain, packed)]
    assert greedy[0] == greedy[1]


def test_packing_leaves_other_dtypes_alone(tiny_model_path: Path) -> None:
    runner = _runner(tiny_model_path, True, dtype="bfloat16")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is None and m.weight.numel() > 0 for m in linears)
