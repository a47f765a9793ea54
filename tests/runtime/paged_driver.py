"""A minimal driver for ModelRunner in tests: places each sequence's KV at scattered slots
(a seeded permutation of the pool), so every read really goes through the request-to-slot table.
Slot 0 is left out, as the KV allocator leaves it: padded decode rows (CUDA graphs) write there."""

from __future__ import annotations

import torch

from runtime.forward_batch import ForwardBatch
from runtime.model_runner import ModelRunner


class PagedDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(seed)
        self._free = (torch.randperm(runner.kv_slots - 1, generator=gen) + 1).tolist()
        self.rows: list[int] = []
        self.lens: list[int] = []

    def _place(self, seq: int, count: int) -> None:
        slots = torch.tensor([self._free.pop() for _ in range(count)])
        self.runner.req_to_token_pool.write(self.rows[seq], self.lens[seq], slots)
        self.lens[seq] += count

    def new_sequence(self) -> int:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None
        self.rows.append(row)
        self.lens.append(0)
        return len(self.rows) - 1

    def batch(
        self, seqs: list[int], token_ids: list[list[int]], logits: str | torch.Tensor = "last"
    ) -> ForwardBatch:
        """Place slots for token_ids[i] after sequence seqs[i] and pack them, unrun."""
        prefix_lens = [self.lens[s] for s in seqs]
        for s, ids in zip(seqs, token_ids, strict=True):
            self._place(s, len(ids))
        return self.runner.build_batch(
            [self.rows[s] for s in seqs], prefix_lens, token_ids, logits=logits
        )

    def extend(
        self, seqs: list[int], token_ids: list[list[int]], logits: str = "last"
    ) -> torch.Tensor:
        """Append token_ids[i] to sequence seqs[i] in one packed forward; returns the logits."""
        return self.runner.forward(self.batch(seqs, token_ids, logits))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one batch, then decode them together greedily."""
        seqs = [self.new_sequence() for _ in prompts]
        next_ids = self.extend(seqs, prompts).argmax(-1).tolist()
        outputs = [[t] for t in next_ids]
        for _ in range(max_new_tokens - 1):
            next_ids = self.extend(seqs, [[t] for t in next_ids]).argmax(-1).tolist()
            for out, t in zip(outputs, next_ids, strict=True):
                out.append(t)
        return outputs
