"""What the DRY penalty costs per decode step: the sampler's DRY work for a batch of requests
(advancing each row's kept match lengths by its new token and penalising its logits row).

Each row's context is a prompt of ``--context`` random tokens followed by outputs that repeat
a 40-token phrase (the looping case, where matches are long), breakers off so nothing ends
them. Prints microseconds per step for each batch size, the mean of ``--steps`` steps, as wall
time and as this process's CPU time (the steadier of the two on a shared machine).

    python -m benchmarks.dry_cost [--batches 16,32] [--context 512] [--steps 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from runtime.dry_penalty import DryState
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.scheduler.token_array import TokenArray

VOCAB = 49152  # SmolLM2's


@dataclass
class _Row:
    """The parts of a request the DRY step reads."""

    sampling: SamplingParams
    token_ids: TokenArray
    dry: DryState = field(default_factory=DryState)


def dry_step_us(batch: int, context: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) microseconds of one step's DRY work for ``batch`` rows."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams.from_dict({"dry_multiplier": 0.8, "dry_sequence_breakers": []})
    phrase = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    rows = [
        _Row(params, TokenArray(torch.randint(0, VOCAB, (context,), generator=gen).tolist()))
        for _ in range(batch)
    ]
    sampler = Sampler(VOCAB, [0])
    logits = torch.zeros(batch, VOCAB)
    for row in rows:  # the first step builds each row's state
        sampler.apply_dry_rows(logits[:1], row, [])  # type: ignore[arg-type]
    wall = cpu = 0.0
    for step in range(steps):
        for row in rows:
            row.token_ids.append(phrase[step % len(phrase)])
        start, start_cpu = time.perf_counter(), time.process_time()
        for i, row in enumerate(rows):
            sampler.apply_dry_rows(logits[i : i + 1], row, [])  # type: ignore[arg-type]
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    return wall / steps * 1e6, cpu / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dry_cost", description=__doc__)
    parser.add_argument("--batches", default="16,32")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    args = parser.parse_args(argv)
    for batch in (int(b) for b in args.batches.split(",")):
        wall, cpu = dry_step_us(batch, args.context, args.steps)
        print(
            f"batch {batch}, context {args.context}: DRY {wall:.0f} us per step wall "
            f"({wall / batch:.0f} per row), {cpu:.0f} us CPU ({cpu / batch:.0f} per row)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
