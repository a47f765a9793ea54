"""Our forward pass against transformers' on the same folder: logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runtime.model_runner import ModelRunner, RunnerConfig
from tests.runtime.paged_driver import PagedDriver

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_arch_model_path: Path) -> tuple[ModelRunner, torch.nn.Module]:
    runner = ModelRunner(
        RunnerConfig(str(tiny_arch_model_path), dtype="float32", kv_slots=4096, max_requests=32)
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_arch_model_path, dtype=torch.float32).eval()
    return runner, hf


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (n,), generator=gen).tolist() for n in lengths]


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_packed_prefill_of_three_prompts(models):
    runner, hf = models
    prompts = _prompts((7, 31, 64), seed=1)
    driver = PagedDriver(runner)
    seqs = [driver.new_sequence() for _ in prompts]
    logits = driver.extend(seqs, prompts, logits="all")
    assert logits.shape == (sum(map(len, prompts)), runner.config.vocab_size)
    for chunk, ids in zip(logits.split([len(p) for p in prompts]), prompts, strict=True):
        torch.testing.assert_close(chunk, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_prefix_then_extension_reuses_prefix_kv(models):
    runner, hf = models
    prefix, suffix = _prompts((40, 13), seed=2)
    driver = PagedDriver(runner, seed=3)
    seq = driver.new_sequence()
    driver.extend([seq], [prefix])
    ext_logits = driver.extend([seq], [suffix], logits="all")
    expected = _hf_logits(hf, prefix + suffix)[len(prefix) :]
    torch.testing.assert_close(ext_logits, expected, atol=ATOL, rtol=0)


def test_mixed_batch_extends_and_prefills_together(models):
    """One packed forward holding a prefix extension, a fresh prompt and a single-token step."""
    runner, hf = models
    a, a_more, b, c, c_more = _prompts((20, 9, 15, 11, 1), seed=4)
    driver = PagedDriver(runner, seed=5)
    sa, sb, sc = (driver.new_sequence() for _ in range(3))
    driver.extend([sa, sc], [a, c])
    logits = driver.extend([sa, sb, sc], [a_more, b, c_more], logits="all")
    parts = logits.split([len(a_more), len(b), len(c_more)])
    torch.testing.assert_close(parts[0], _hf_logits(hf, a + a_more)[len(a) :], atol=ATOL, rtol=0)
    torch.testing.assert_close(parts[1], _hf_logits(hf, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(parts[2], _hf_logits(hf, c + c_more)[len(c) :], atol=ATOL, rtol=0)


def test_twenty_decode_steps_at_different_lengths(models):
    runner, hf = models
    prompts = _prompts((3, 25, 50, 80), seed=6)
    continuations = _prompts((20, 20, 20, 20), seed=7)
    driver = PagedDriver(runner, seed=8)
    seqs = [driver.new_sequence() for _ in prompts]
    driver.extend(seqs, prompts)
    steps = []
    for step in range(20):
        steps.append(driver.extend(seqs, [[c[step]] for c in continuations]))
    decoded = torch.stack(steps, dim=1)  # [B, 20, V]
    for b, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        # The logits after feeding cont[step] sit at position len(prompt) + step.
        expected = _hf_logits(hf, prompt + cont)[len(prompt) :]
        torch.testing.assert_close(decoded[b], expected, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers_generate(models):
    runner, hf = models
    prompts = _prompts((5, 18, 40), seed=9)
    ours = PagedDriver(runner, seed=10).greedy(prompts, max_new_tokens=32)
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_last_layer_runs_only_the_logit_rows(models):
    """When every logit row is its request's last new token, the last layer computes only those
    rows past its K/V; the logits still match, and the skipped rows' K/V are still written."""
    runner, hf = models
    a, b, c, c_more, a_next = _prompts((23, 17, 12, 1, 5), seed=9)
    driver = PagedDriver(runner, seed=10)
    sa, sb, sc = (driver.new_sequence() for _ in range(3))
    driver.extend([sc], [c])
    # a and c_more end here (logit rows); b is a prefill chunk that does not (no logit row).
    batch = driver.batch([sa, sb, sc], [a, b, c_more], logits=torch.tensor([22, 40]))
    assert batch.logit_reqs is not None and batch.logit_reqs.tolist() == [0, 2]
    logits = runner.forward(batch)
    torch.testing.assert_close(logits[0], _hf_logits(hf, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], _hf_logits(hf, c + c_more)[-1], atol=ATOL, rtol=0)
    # Every token of a and b left its K/V in the last layer too: continuing them is exact.
    more = driver.extend([sa, sb], [a_next, [7]], logits="all")
    torch.testing.assert_close(
        more[: len(a_next)], _hf_logits(hf, a + a_next)[len(a) :], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(more[-1], _hf_logits(hf, b + [7])[-1], atol=ATOL, rtol=0)


def test_logit_rows_other_than_last_tokens_take_the_full_path(models):
    runner, _ = models
    driver = PagedDriver(runner, seed=11)
    seqs = [driver.new_sequence() for _ in range(2)]
    prompts = _prompts((6, 4), seed=12)
    assert driver.batch(seqs, prompts, logits="all").logit_reqs is None
    assert driver.batch(seqs, prompts, logits=torch.tensor([2, 9])).logit_reqs is None
    assert driver.batch(seqs, [[1], [2]]).logit_reqs is None  # decode: every row is a logit row
