"""The draft-model worker: greedy proposals equal a full recompute whatever the caller accepted,
its KV stays accounted for, and lack of room shortens drafts instead of failing."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radix_cache import CacheInvariantError, KVSlotAllocator, RadixCache
from runtime.memory_pool import ReqToTokenPool
from runtime.model_runner import RunnerConfig
from runtime.speculative.draft_kv import DraftKVManager
from runtime.speculative.draft_worker import DraftJob, DraftModelWorker
from runtime.test_model import cached_draft_model, cached_test_model
from tests.runtime.helpers import random_prompts


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def draft_path(request: pytest.FixtureRequest) -> Path:
    return cached_draft_model(cached_test_model("tiny", request.param), num_layers=1)


@functools.cache
def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference(path: Path, ids: list[int], n: int) -> list[int]:
    """The draft model's greedy continuation, running the whole sequence at every step."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(_hf(path)(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def greedy(logits: torch.Tensor, active: list[int], step: int) -> list[int]:
    return logits.argmax(-1).tolist()


def make_worker(path: Path, max_catch_up_tokens: int = 8192, **kwargs) -> DraftModelWorker:
    options = dict(dtype="float32", kv_slots=2048, max_requests=8, context_len=512) | kwargs
    return DraftModelWorker(
        RunnerConfig(str(path), **options), max_catch_up_tokens=max_catch_up_tokens
    )


def assert_all_cached_or_free(worker: DraftModelWorker) -> None:
    worker.check_invariants()
    tree, allocator = worker.kv.tree, worker.kv.allocator
    assert not worker.kv.seqs and tree.protected_size() == 0
    assert allocator.available() + tree.evictable_size() == allocator.capacity


def test_greedy_proposals_equal_a_full_recompute(draft_path: Path):
    worker = make_worker(draft_path)
    prompts = random_prompts([5, 17, 1, 40], seed=1)
    wanted = [4, 1, 6, 3]
    jobs = [DraftJob(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, wanted, strict=True))]
    drafts = worker.propose(jobs, greedy)
    assert drafts == [reference(draft_path, p, n) for p, n in zip(prompts, wanted, strict=True)]
    worker.check_invariants()


def test_resync_after_partial_acceptance(draft_path: Path):
    worker = make_worker(draft_path)
    seqs = random_prompts([12, 20, 9, 30, 15], seed=2)
    jobs = [DraftJob(f"r{i}", s, 4) for i, s in enumerate(seqs)]
    drafts = worker.propose(jobs, greedy)
    worker.check_invariants()
    # Accept 0, 1 (then two more tokens, as after steps without drafting), all 4 (with a bonus
    # token), nothing new at all, and a sequence rewritten inside its prompt: each must draft
    # as if computed from scratch.
    seqs = [
        seqs[0] + [7],
        seqs[1] + drafts[1][:1] + [(drafts[1][1] + 1) % 4000, drafts[1][2]],
        seqs[2] + drafts[2] + [11],
        seqs[3],
        seqs[4][:6] + [3, 3, 3],
    ]
    for round_ in range(3):
        jobs = [DraftJob(f"r{i}", s, 3 + i % 2) for i, s in enumerate(seqs)]
        drafts = worker.propose(jobs, greedy)
        assert drafts == [reference(draft_path, j.token_ids, j.num_tokens) for j in jobs]
        worker.check_invariants()
        seqs = [
            s + d[: (i + round_) % 3] + [100 + i]
            for i, (s, d) in enumerate(zip(seqs, drafts, strict=True))
        ]
    assert worker.stats["kept_draft_tokens"] > 0  # accepted drafts were not recomputed
    for i in range(len(seqs)):
        worker.release(f"r{i}")
    worker.release("never-seen")
    assert_all_cached_or_free(worker)


def test_requests_sharing_a_prefix_compute_it_once(draft_path: Path):
    worker = make_worker(draft_path)
    shared, tail_a, tail_b, tail_c = random_prompts([100, 5, 7, 3], seed=3)
    tail_b[0] = (tail_a[0] + 1) % 4000
    worker.propose([DraftJob("a", shared + tail_a, 2)], greedy)
    assert worker.stats["extend_tokens"] == 105
    # "a" is still running: its prompt went into the tree once it was computed.
    before = worker.stats["extend_tokens"]
    drafts = worker.propose([DraftJob("b", shared + tail_b, 2)], greedy)
    assert worker.stats["extend_tokens"] - before == 7
    assert worker.stats["cache_hit_tokens"] == 100
    assert drafts == [reference(draft_path, shared + tail_b, 2)]
    worker.release("a")
    worker.release("b", keep_in_cache=False)
    worker.check_invariants()
    before = worker.stats["extend_tokens"]
    worker.propose([DraftJob("c", shared + tail_a + tail_c, 2)], greedy)
    assert worker.stats["extend_tokens"] - before == 3  # "a"'s whole sequence was kept
    worker.check_invariants()


def test_requests_of_different_cache_salts_share_no_draft_kv(draft_path: Path):
    worker = make_worker(draft_path)
    shared, tail_a, tail_b = random_prompts([100, 5, 7], seed=4)
    tail_b[0] = (tail_a[0] + 1) % 4000
    worker.propose([DraftJob("a", shared + tail_a, 2, "tenant-a")], greedy)
    before = worker.stats["extend_tokens"]
    drafts = worker.propose([DraftJob("b", shared + tail_b, 2, "tenant-b")], greedy)
    assert worker.stats["extend_tokens"] - before == 107  # the shared part computed again
    assert worker.stats["cache_hit_tokens"] == 0
    assert drafts == [reference(draft_path, shared + tail_b, 2)]
    worker.propose([DraftJob("c", shared + tail_b, 2, "tenant-a")], greedy)
    assert worker.stats["cache_hit_tokens"] == 100  # its own salt's prefix
    for key in "abc":
        worker.release(key)
    assert_all_cached_or_free(worker)


def test_a_full_pool_shortens_drafts_and_never_raises(draft_path: Path):
    worker = make_worker(draft_path, kv_slots=64, max_requests=3)  # 63 usable slots
    prompts = random_prompts([30, 25, 100, 20, 10], seed=4)
    for round_ in range(4):
        jobs = [DraftJob(f"r{i}", p, 4) for i, p in enumerate(prompts)]
        drafts = worker.propose(jobs, greedy)
        worker.check_invariants()
        assert drafts[2] == [] and "r2" not in worker.kv.seqs  # longer than the pool
        assert any(d == [] for d in drafts[:2] + drafts[3:])  # rows or slots ran out
        for job, draft in zip(jobs, drafts, strict=True):
            assert draft == reference(draft_path, job.token_ids, job.num_tokens)[: len(draft)]
        worker.release(f"r{round_ % 5}")
        prompts = [p + d[:1] + [9] for p, d in zip(prompts, drafts, strict=True)]
        worker.check_invariants()
    assert worker.stats["jobs_without_room"] > 0
    for i in range(5):
        worker.release(f"r{i}")
    assert_all_cached_or_free(worker)


def test_stop_ends_only_that_job(draft_path: Path):
    worker = make_worker(draft_path)
    prompts = random_prompts([8, 9, 10], seed=5)
    seen: list[tuple[list[int], int]] = []

    def choose(logits: torch.Tensor, active: list[int], step: int) -> list[int]:
        seen.append((list(active), step))
        tokens = logits.argmax(-1).tolist()
        return [
            -1 if (job == 1 and step == 1) else t for job, t in zip(active, tokens, strict=True)
        ]

    drafts = worker.propose([DraftJob(f"r{i}", p, 4) for i, p in enumerate(prompts)], choose)
    expected = [reference(draft_path, p, 4) for p in prompts]
    assert drafts == [expected[0], expected[1][:1], expected[2]]
    assert seen == [([0, 1, 2], 0), ([0, 1, 2], 1), ([0, 2], 2), ([0, 2], 3)]
    worker.check_invariants()


def test_a_long_backlog_catches_up_in_chunks(draft_path: Path):
    worker = make_worker(draft_path, max_catch_up_tokens=16)
    long, short = random_prompts([40, 4], seed=6)
    jobs = [DraftJob("long", long, 3), DraftJob("short", short, 3)]
    assert worker.propose(jobs, greedy) == [[], reference(draft_path, short, 3)]
    worker.check_invariants()
    short = short + [5]
    calls = 1
    for _ in range(5):
        drafts = worker.propose([DraftJob("long", long, 3), DraftJob("short", short, 3)], greedy)
        calls += 1
        worker.check_invariants()
        if drafts[0]:
            break
    # The short job goes first each call; the long one computes 12, 15, then its last 13.
    assert calls == 3
    assert drafts == [reference(draft_path, long, 3), reference(draft_path, short, 3)]


def test_drafts_stop_at_the_context_length(draft_path: Path):
    worker = make_worker(draft_path, context_len=32)
    fits, at_limit, too_long = random_prompts([30, 32, 33], seed=7)
    jobs = [DraftJob("a", fits, 5), DraftJob("b", at_limit, 5), DraftJob("c", too_long, 5)]
    drafts = worker.propose(jobs, greedy)
    assert drafts == [reference(draft_path, fits, 3), reference(draft_path, at_limit, 1), []]
    worker.check_invariants()


def test_flush_waits_for_locks(draft_path: Path):
    worker = make_worker(draft_path)
    worker.propose([DraftJob("a", random_prompts([20], seed=8)[0], 2)], greedy)
    assert not worker.flush()  # "a" pins its prompt
    worker.release("a")
    assert worker.flush() and worker.kv.tree.total_size() == 0
    assert_all_cached_or_free(worker)


def test_malformed_calls_raise_value_error(draft_path: Path):
    worker = make_worker(draft_path)
    with pytest.raises(ValueError, match="twice"):
        worker.propose([DraftJob("a", [1, 2], 1), DraftJob("a", [3], 1)], greedy)
    with pytest.raises(ValueError, match=">= 1"):
        worker.propose([DraftJob("a", [1, 2], 0)], greedy)
    with pytest.raises(ValueError, match="returned 0 tokens"):
        worker.propose([DraftJob("a", [1, 2], 2)], lambda logits, active, step: [])
    with pytest.raises(ValueError, match="outside"):
        worker.propose([DraftJob("a", [1, 2], 2)], lambda logits, active, step: [10**6])
    worker.check_invariants()
    assert worker.vocab_size == 4096


def test_draft_kv_accounting_without_a_model():
    """The draft's sequences on the shared KV accounting: drafted tokens' slots are freed on
    release, confirmed ones cached for the next request, and the check sees a sequence whose
    tokens disagree with its KV."""
    allocator = KVSlotAllocator(32)
    kv = DraftKVManager(
        allocator, RadixCache(allocator), ReqToTokenPool(4, 64, torch.device("cpu"))
    )
    tokens = np.arange(10, dtype=np.int32)
    seq, admitted = kv.prepare("a", tokens)
    assert admitted and seq is not None and kv.grow(seq, tokens, confirmed=True)
    kv.cache_prefix(seq, 9)
    assert kv.grow(seq, [5, 6], confirmed=False) and seq.kv.kv_len == 12
    kv.check_seqs()
    kv.release("a", keep_in_cache=True)
    kv.check_seqs()
    assert kv.tree.total_size() == 10 and allocator.available() == allocator.capacity - 10
    seq, admitted = kv.prepare("b", np.array([*range(9), 7], dtype=np.int32))
    assert admitted and seq is not None and seq.kv.cached_len == 9
    seq.tokens = seq.tokens[:3]
    with pytest.raises(CacheInvariantError):
        kv.check_seqs()
