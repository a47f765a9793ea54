"""Draft-model proposals for speculative decoding: a small model drafts K tokens per request,
batched across requests, for the target model to verify.

The worker owns its model, its KV pool, its request-to-slot table and its own radix tree. The
draft's KV cannot live in the target's tree: the two models' KV differ in shape and meaning, so
every slot index means something else in each pool.

It is self-synchronising. The caller never reports which drafts were accepted; each
``propose`` hands over the request's whole known sequence, and the worker compares it with the
tokens its KV holds for that request: the agreed prefix stays (accepted draft tokens included,
their KV computed while drafting), anything past it is freed, and the missing tokens run in one
batched extend forward for all jobs. Acceptance, rejection, a bonus token, a retraction that
came back or a jump-forward all reduce to the same comparison, so the worker cannot drift from
the target whatever the scheduler did between calls.

Requests sharing a prefix share draft KV through the tree: a new request is admitted by prefix
match and lock, its prompt goes into the tree as soon as it is computed (so requests arriving
meanwhile reuse it), and ``release`` inserts what it computed. Drafting is best effort: when
memory, table rows or the context run out, a job proposes fewer tokens or none; a request
never fails and ``propose`` never raises for lack of room.

Not thread-safe: one scheduler thread calls it. Logits handed to ``choose`` are on the
worker's device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radix_cache import KVSlotAllocator, RadixCache
from radix_cache.node import as_token_array
from runtime.forward_batch import ForwardBatch
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.speculative.draft_kv import DraftKVManager, DraftSeq

# choose(logits, active, step) -> tokens: logits [len(active), V] float32 are the draft model's
# next-token logits for jobs[active[j]] at draft position ``step`` (0-based); returns one token
# id per active job, or -1 for a job that should stop drafting now.
ChooseFn = Callable[[torch.Tensor, list[int], int], list[int]]

STOP = -1  # what ``choose`` returns for a job that drafts no further


@dataclass
class DraftJob:
    """One request's drafting work for one ``propose`` call.

    key: the request's id; the worker keeps its KV between calls under it.
    token_ids: the request's whole known sequence now (prompt + output so far); an int32 numpy
        array (such as a ``TokenArray`` prefix view) is used without conversion.
    num_tokens: draft tokens wanted (>= 1).
    cache_salt: the request's cache salt: its draft KV is shared only with requests of the
        same salt (the draft tree's namespace), as the target's is.
    """

    key: str
    token_ids: Sequence[int] | np.ndarray
    num_tokens: int
    cache_salt: str | None = None


class DraftModelWorker:
    """Owns a draft model with its own KV pool and radix tree; proposes tokens per request.

    runner: its model's ``RunnerConfig`` (cascade attention and CUDA graphs are off whatever it
    says). eviction_policy: the draft tree's. max_catch_up_tokens: the most tokens one
    ``propose`` call computes to bring requests up to date (summed over its jobs); a longer
    backlog is caught up in chunks over later calls, its job proposing nothing until it is
    done. ``stats`` counts, since construction, forwards, tokens computed, cache hits and jobs
    left without a draft.
    """

    def __init__(
        self, runner: RunnerConfig, eviction_policy: str = "lru", max_catch_up_tokens: int = 8192
    ) -> None:
        if max_catch_up_tokens < 1:
            raise ValueError(f"max_catch_up_tokens must be >= 1, got {max_catch_up_tokens}")
        self.runner = ModelRunner(
            dataclasses.replace(runner, cascade_min_prefix=None, disable_cuda_graph=True)
        )
        allocator = KVSlotAllocator(self.runner.kv_slots)
        tree = RadixCache(allocator, policy=eviction_policy)
        self.kv = DraftKVManager(allocator, tree, self.runner.req_to_token_pool)
        self.context_len = self.runner.context_len
        self.max_catch_up_tokens = max_catch_up_tokens
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "propose_calls",
                "forward_calls",
                "extend_tokens",  # tokens computed bringing requests up to date
                "decode_tokens",  # draft tokens fed back to draft the next one
                "cache_hit_tokens",  # tokens a new request found in the tree
                "kept_draft_tokens",  # drafted tokens the request then took, KV kept
                "proposed_tokens",
                "jobs_without_room",  # jobs that proposed nothing: no memory, row or context
                "jobs_catching_up",  # jobs that proposed nothing: backlog over the budget
            ),
            0,
        )

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def propose(self, jobs: Sequence[DraftJob], choose: ChooseFn) -> list[list[int]]:
        """Draft up to ``job.num_tokens`` tokens per job; returns them in job order (a list may
        be shorter, or empty, when ``choose`` stopped it or room ran out).

        Raises ValueError for malformed jobs (repeated key, empty sequence, num_tokens < 1)
        and for ``choose`` answers of the wrong length or outside the vocabulary.
        """
        self._check_jobs(jobs)
        self.stats["propose_calls"] += 1
        tokens = [as_token_array(job.token_ids) for job in jobs]
        drafts: list[list[int]] = [[] for _ in jobs]
        seqs = self._prepare(jobs, tokens)
        ready, logits = self._catch_up(seqs, tokens)
        # The last drafted token's KV is never needed; KV stays inside the context.
        limits = {i: min(jobs[i].num_tokens, self.context_len - tokens[i].size + 1) for i in ready}
        active, step = ready, 0
        while active:
            chosen = self._checked(choose(logits, active, step), len(active))
            fed: list[int] = []
            for i, token in zip(active, chosen, strict=True):
                if token == STOP:
                    continue
                drafts[i].append(token)
                if len(drafts[i]) < limits[i] and self.kv.grow(seqs[i], [token], False):
                    fed.append(i)
            if not fed:
                break
            rows = [seqs[i].row for i in fed]
            prefix_lens = [seqs[i].kv.kv_len - 1 for i in fed]
            batch = self.runner.build_batch(rows, prefix_lens, [[drafts[i][-1]] for i in fed])
            logits = self._forward(batch, [seqs[i] for i in fed])
            self.stats["decode_tokens"] += len(fed)
            active, step = fed, step + 1
        self.stats["proposed_tokens"] += sum(len(d) for d in drafts)
        return drafts

    def release(self, key: str, keep_in_cache: bool = True) -> None:
        """The request finished, was retracted or aborted: free what ``key`` holds. With
        ``keep_in_cache`` its computed sequence goes into the draft tree for later requests to
        reuse. Unknown keys are ignored."""
        self.kv.release(key, keep_in_cache)

    def check_invariants(self) -> None:
        """Raise CacheInvariantError unless free + cached + private == capacity, no slot is
        owned twice and no table row leaked. O(cached tokens): for tests and debug runs."""
        self.kv.check_seqs()

    def flush(self) -> bool:
        """Drop the draft tree's entries; refused (False) while requests hold locks on it."""
        return self.kv.flush()

    def _check_jobs(self, jobs: Sequence[DraftJob]) -> None:
        keys = [job.key for job in jobs]
        if len(set(keys)) != len(keys):
            raise ValueError("a request appears twice in one propose() call")
        for job in jobs:
            if job.num_tokens < 1:
                raise ValueError(f"job {job.key!r} wants {job.num_tokens} draft tokens; need >= 1")
            if len(job.token_ids) == 0:
                raise ValueError(f"job {job.key!r} has no tokens to draft after")

    def _prepare(self, jobs: Sequence[DraftJob], tokens: list[np.ndarray]) -> dict[int, DraftSeq]:
        """Admit or synchronise each job's sequence (job index -> sequence); jobs left out
        have no room (no table row, a sequence past the context, or a token the draft's
        vocabulary lacks)."""
        seqs: dict[int, DraftSeq] = {}
        for i, job in enumerate(jobs):
            ids = tokens[i]
            if ids.size > self.context_len or ids.min() < 0 or ids.max() >= self.vocab_size:
                self.stats["jobs_without_room"] += 1
                continue
            held = self.kv.seqs.get(job.key)
            held_confirmed = held.confirmed if held is not None else 0
            seq, admitted = self.kv.prepare(job.key, ids, job.cache_salt)
            if seq is None:
                self.stats["jobs_without_room"] += 1
                continue
            if admitted:
                self.stats["cache_hit_tokens"] += seq.kv.cached_len
            else:
                self.stats["kept_draft_tokens"] += max(0, seq.kv.kv_len - held_confirmed)
            seqs[i] = seq
        return seqs

    def _catch_up(
        self, seqs: dict[int, DraftSeq], tokens: list[np.ndarray]
    ) -> tuple[list[int], torch.Tensor]:
        """Compute the tokens each sequence lacks, within the budget, in one extend forward.

        Returns the jobs now fully caught up (in job order) and their next-token logits
        [len(ready), V]: the first draft step's. Every other job leaves ``seqs``; one whose KV
        does not fit and holds nothing private also gives back its row and lock.
        """
        budget = self.max_catch_up_tokens
        work: list[tuple[int, int, int]] = []  # (job, start, end): positions to compute
        waiting = 0  # jobs with a backlog left for later calls
        # Short backlogs first: a long prompt takes what is left, not the decodes' turn.
        for i in sorted(seqs, key=lambda i: tokens[i].size - seqs[i].kv.kv_len):
            seq, ids = seqs[i], tokens[i]
            start = seq.kv.kv_len
            end = min(ids.size, start + budget)
            if end > start and self.kv.grow(seq, ids[start:end], confirmed=True):
                budget -= end - start
                work.append((i, start, end))
            elif end > start:
                self.stats["jobs_without_room"] += 1
                if seq.kv.kv_len == seq.kv.cached_len:
                    self.kv.release(seq.key, keep_in_cache=False)
            else:
                waiting += 1
        ready = sorted(i for i, _, end in work if end == tokens[i].size)
        self.stats["jobs_catching_up"] += waiting + len(work) - len(ready)
        if not work:
            return [], torch.empty(0)
        work.sort(key=lambda w: w[2] - w[1] == 1)  # multi-token extends first in a batch
        packed_end, last_row = 0, {}
        for i, start, end in work:
            packed_end += end - start
            last_row[i] = packed_end - 1
        batch = self.runner.build_batch(
            [seqs[i].row for i, _, _ in work],
            [start for _, start, _ in work],
            [tokens[i][start:end].tolist() for i, start, end in work],
            logits=torch.tensor([last_row[i] for i in ready], dtype=torch.int64),
        )
        logits = self._forward(batch, [seqs[i] for i, _, _ in work])
        self.stats["extend_tokens"] += packed_end
        for i, _, end in work:
            seq, size = seqs[i], tokens[i].size
            if not seq.prefilled:  # its prompt: shared with requests arriving meanwhile
                self.kv.cache_prefix(seq, min(end, size - 1))
                seq.prefilled = end == size
        return ready, logits

    def _forward(self, batch: ForwardBatch, seqs: list[DraftSeq]) -> torch.Tensor:
        """Run ``batch``; if it raises, the sequences' KV may be half-written: drop them."""
        self.stats["forward_calls"] += 1
        try:
            return self.runner.forward(batch)
        except BaseException:
            for seq in seqs:
                self.kv.release(seq.key, keep_in_cache=False)
            raise

    def _checked(self, chosen: Sequence[int], expected: int) -> list[int]:
        tokens = [int(t) for t in chosen]
        if len(tokens) != expected:
            raise ValueError(f"choose returned {len(tokens)} tokens for {expected} active jobs")
        for token in tokens:
            if token != STOP and not 0 <= token < self.vocab_size:
                raise ValueError(f"choose returned token {token}, outside [0, {self.vocab_size})")
        return tokens
