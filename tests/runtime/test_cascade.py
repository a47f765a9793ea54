"""Shared-prefix (cascade) decode attention: the plan read off the slot table, and a model
forward / Engine generation that equals the plain path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import arbor_kernels as kernels
import pytest
import torch

from runtime import Engine, forward_batch
from runtime.cascade import CascadePlan, plan_cascade
from runtime.model_runner import ModelRunner, RunnerConfig


def _table(prefixes: list[list[int]], width: int = 200) -> torch.Tensor:
    """Row i holds prefixes[i] then slots 1000 * (i + 1) + position, its own."""
    table = torch.zeros(len(prefixes), width, dtype=torch.int64)
    for i, prefix in enumerate(prefixes):
        table[i] = 1000 * (i + 1) + torch.arange(width)
        table[i, : len(prefix)] = torch.tensor(prefix, dtype=torch.int64)
    return table


def test_plan_groups_rows_by_shared_slots() -> None:
    header = list(range(50))
    table = _table([header, header, header[:30], [7] * 60, header + [99] * 10])
    plan = plan_cascade(table, [0, 1, 2, 3, 4], [80, 90, 70, 80, 100], min_prefix=16)
    assert plan is not None
    # Rows 0, 1, 4 share 50 slots, row 2 only 30: (3 - 1) x 50 K/V reads saved beats
    # (4 - 1) x 30; row 3 shares nothing.
    assert plan.sharers.tolist() == [0, 1, 4]
    assert plan.prefix_lens.tolist() == [50]
    assert plan.prefix_rows.tolist() == [0]
    assert plan.kv_start.tolist() == [50, 50, 0, 0, 50]


def test_plan_prefers_more_sharers_over_a_longer_prefix_when_it_saves_more() -> None:
    header = list(range(100))
    table = _table([header, header[:100], header[:40], header[:40], header[:40]])
    plan = plan_cascade(table, [0, 1, 2, 3, 4], [150] * 5, min_prefix=32)
    assert plan is not None
    assert plan.prefix_lens.tolist() == [40]  # (5 - 1) x 40 saved beats (2 - 1) x 100
    assert plan.sharers.tolist() == [0, 1, 2, 3, 4]


def test_plan_never_shares_a_requests_own_new_token_or_too_little() -> None:
    header = list(range(40))
    # Sequences of 41 tokens: 40 shared positions at most, the 41st is each one's new token.
    table = _table([header, header])
    plan = plan_cascade(table, [0, 1], [41, 41], min_prefix=32)
    assert plan is not None and plan.prefix_lens.tolist() == [40]
    assert plan_cascade(table, [0, 1], [41, 41], min_prefix=41) is None
    assert plan_cascade(_table([header, [5] * 40]), [0, 1], [41, 41], min_prefix=8) is None


@pytest.fixture
def native_backend() -> Iterator[None]:
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    previous = kernels.kernel_backend()
    kernels.set_kernel_backend("native")
    yield
    kernels.set_kernel_backend(previous)


@pytest.mark.parametrize("page_size", [1, 16])
def test_forward_with_cascade_equals_plain(
    tiny_model_path: Path, native_backend: None, page_size: int
) -> None:
    """Fork branches: four requests share a 45-token prompt (ending mid-page), two of them also
    a further 10 tokens; two loners decode beside them in a MIXED batch with a prefill."""
    runner = ModelRunner(
        RunnerConfig(str(tiny_model_path), kv_slots=2048, max_requests=8, page_size=page_size)
    )
    pool = runner.req_to_token_pool
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 4000, (45,), generator=gen).tolist()
    shared_row = pool.alloc()
    assert shared_row is not None
    pool.write(shared_row, 0, torch.arange(45))
    runner.forward(runner.build_batch([shared_row], [0], [prompt]))
    rows, lens, next_slot = [], [], 45
    for branch in range(6):
        row = pool.alloc()
        assert row is not None
        own = 10 + branch
        if branch < 4:
            pool.write(row, 0, pool.req_to_token[shared_row, :45])
            start, ids = 45, torch.randint(5, 4000, (own,), generator=gen).tolist()
        else:
            start, ids = 0, torch.randint(5, 4000, (45 + own,), generator=gen).tolist()
        pool.write(row, start, torch.arange(next_slot, next_slot + len(ids)))
        next_slot += len(ids)
        runner.forward(runner.build_batch([row], [start], [ids]))
        rows.append(row)
        lens.append(start + len(ids))
    prefill_row = pool.alloc()
    assert prefill_row is not None
    pool.write(prefill_row, 0, torch.arange(next_slot, next_slot + 20))
    next_slot += 20
    decode_slots = torch.arange(next_slot, next_slot + 6)
    for row, length, slot in zip(rows, lens, decode_slots.tolist(), strict=True):
        pool.write(row, length, torch.tensor([slot]))
    prefill_ids = torch.randint(5, 4000, (20,), generator=gen).tolist()
    args = ([prefill_row, *rows], [0, *lens], [prefill_ids] + [[17 + i] for i in range(6)])

    runner.cascade_min_prefix = None
    plain_batch = runner.build_batch(*args)
    assert plain_batch.cascade is None
    plain = runner.forward(plain_batch)
    runner.cascade_min_prefix = 32
    cascade_batch = runner.build_batch(*args)
    assert cascade_batch.cascade is not None
    assert cascade_batch.cascade.sharers.tolist() == [0, 1, 2, 3]
    assert cascade_batch.cascade.prefix_lens.tolist() == [45]
    torch.testing.assert_close(runner.forward(cascade_batch), plain, atol=1e-5, rtol=1e-5)


def _greedy(model: Path, backend: str, cascade: bool) -> list[list[int]]:
    prompt = "Shared few-shot header: " + " ".join(f"example {i} -> {i * i};" for i in range(12))
    questions = [prompt + f" question {q} ->" for q in range(6)]
    with Engine(
        model, max_total_tokens=8192, kernel_backend=backend,
        disable_cascade_attention=not cascade, debug_invariants=True,
    ) as engine:  # fmt: skip
        outs = engine.generate(questions, {"temperature": 0, "max_new_tokens": 24})
    return [out["output_ids"] for out in outs]


def test_engine_greedy_unchanged_by_native_kernels_and_cascade(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels.native_available():
        pytest.fail("native CPU kernels are not built: run `python -m arbor_kernels.cpu_native`")
    planned: list[int] = []

    def counting_plan(*args: Any) -> CascadePlan | None:
        plan = plan_cascade(*args)
        if plan is not None:
            planned.append(int(plan.sharers.numel()))
        return plan

    monkeypatch.setattr(forward_batch, "plan_cascade", counting_plan)
    previous = kernels.kernel_backend()
    try:
        reference = _greedy(tiny_model_path, "torch", cascade=False)
        assert _greedy(tiny_model_path, "native", cascade=False) == reference
        assert not planned
        assert _greedy(tiny_model_path, "native", cascade=True) == reference
    finally:
        kernels.set_kernel_backend(previous)
    assert max(planned) == 6  # the six questions decoded with their header shared
