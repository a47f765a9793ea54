"""random: independent prompts of random tokens with random input and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.suite.systems.arbor import Request
from benchmarks.suite.workloads.base import RequestListWorkload
from benchmarks.suite.workloads.text import ordinary_token_ids


@dataclass(frozen=True)
class RandomLengths(RequestListWorkload):
    """``requests`` prompts of uniformly random ordinary tokens; input and output lengths drawn
    uniformly from the inclusive ranges; EOS ignored so every output has its drawn length."""

    name = "random"
    summary = "independent random prompts, random input/output lengths (ignore_eos)"
    count_field = "requests_count"

    requests_count: int = 128
    input_len: tuple[int, int] = (32, 1024)
    output_len: tuple[int, int] = (16, 256)

    @classmethod
    def preset(cls, quick: bool) -> RandomLengths:
        if quick:
            return cls(requests_count=16, input_len=(32, 256), output_len=(8, 64))
        return cls()

    def requests(self, tokenizer: Any) -> list[Request]:
        rng = random.Random(self.seed)
        ids = ordinary_token_ids(tokenizer)
        return [
            Request(
                tuple(rng.choice(ids) for _ in range(rng.randint(*self.input_len))),
                rng.randint(*self.output_len),
                group=i,
            )
            for i in range(self.requests_count)
        ]
