"""Projection weights packed into oneDNN's layout on CPU, float32 and (with AVX512-BF16)
bfloat16: same logits, one copy; bfloat16 sums in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import runtime.layers.basic as basic
from runtime.cpu_features import cpu_flags, has_bf16_dot
from runtime.layers.basic import Linear, onednn_packing_available, pack_weight, packed_linear
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


def test_bfloat16_is_packed_only_where_the_cpu_has_bf16_dot_products() -> None:
    bf16, fp32 = torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4, 4)
    with_dot, without = frozenset({"avx512f", "avx512_bf16"}), frozenset({"avx512f", "avx2"})
    assert onednn_packing_available(bf16, with_dot)
    assert not onednn_packing_available(bf16, without)
    assert onednn_packing_available(fp32, without)
    assert not onednn_packing_available(bf16.half(), with_dot)


def test_packing_leaves_bfloat16_alone_without_bf16_dot_products(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(basic, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    runner = _runner(tiny_model_path, True, dtype="bfloat16")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is None and m.weight.numel() > 0 for m in linears)


needs_bf16_dot = pytest.mark.skipif(
    not has_bf16_dot(cpu_flags()), reason="this CPU has no AVX512-BF16"
)


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_packed_bfloat16_sums_in_float32(rows: int) -> None:
    """Each output is the exact product of the bfloat16 inputs rounded to bfloat16 once (within
    one bfloat16 step: 2^-7 relative); summing 1536 products in bfloat16 would be far off."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(576, 1536, generator=gen).bfloat16()
    x = torch.randn(rows, 1536, generator=gen).bfloat16()
    bias = torch.randn(576, generator=gen).bfloat16()
    out = packed_linear(x, pack_weight(weight), bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 576)
    step = exact.abs().clamp_min(1e-30) * 2.0**-7
    assert ((out.double() - exact).abs() <= step).all()


@needs_bf16_dot
def test_packed_bfloat16_gives_the_unpacked_logits(tiny_arch_model_path: Path) -> None:
    plain = _runner(tiny_arch_model_path, False, dtype="bfloat16")
    packed = _runner(tiny_arch_model_path, True, dtype="bfloat16")
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert all(m.packed.dtype == torch.bfloat16 for m in linears if m.packed is not None)
    prompts = [[5, 17, 300, 42, 9, 1000, 77], [8, 8, 8, 2000]]
    logits = [_prefill_logits(r, prompts) for r in (plain, packed)]
    scale = logits[0].abs().max().item()
    assert (logits[1] - logits[0]).abs().max().item() <= 0.05 * scale
    agree = (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean().item()
    assert agree >= 0.9
