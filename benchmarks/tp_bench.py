"""Tensor parallelism on this machine: decode step and prefill time at tp_size 1 and 2.

For each tp_size, starts the model runner a scheduler would (rank 0, which starts the other
ranks and broadcasts each step to them), then times B one-token requests at context L (a
decode step) and one prompt of P tokens (a prefill), and on rank 0 the time spent inside the
collectives (the step's broadcast, the all-reduces, the logits' gather; this includes waiting
for the slower rank). CPU threads are split between the ranks as under ``--tp``.

    python -m benchmarks.tp_bench [--preset small] [--tp 1,2] [--batches 1,32]
        [--context 128] [--prefill 512] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.common import machine, print_table, timed_into, write_json
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.test_model import cached_test_model
from runtime.tp_runner import start_model_runner


def _time_collectives(runner: ModelRunner, clock: list[float]) -> None:
    """Add the wall time of every collective rank 0 calls to clock[0]."""
    group = runner.tp

    for name in ("all_reduce", "gather_to_leader", "broadcast"):
        setattr(group, name, timed_into(getattr(group, name), clock))


def _rows(runner: ModelRunner, batch: int, context: int, first_slot: int) -> list[int]:
    rows = []
    for i in range(batch):
        row = runner.req_to_token_pool.alloc()
        assert row is not None
        start = first_slot + i * context
        runner.req_to_token_pool.write(row, 0, torch.arange(start, start + context))
        rows.append(row)
    return rows


def _measure(
    runner: ModelRunner,
    rows: list[int],
    prefix_lens: list[int],
    new_ids: list[list[int]],
    repeat: int,
    clock: list[float],
) -> tuple[float, float, float]:
    """(median, best, median collective) seconds of the forward of ``new_ids`` after
    ``prefix_lens`` tokens in ``rows``, over ``repeat`` runs after one warm-up."""

    def run() -> None:
        runner.forward(runner.build_batch(rows, prefix_lens, new_ids))

    run()
    times, collective = [], []
    for _ in range(repeat):
        clock[0] = 0.0
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        collective.append(clock[0])
    return statistics.median(times), min(times), statistics.median(collective)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = cached_test_model(args.preset, "llama")
    slots = max(batches) * args.context + args.prefill + 64
    results: list[dict[str, Any]] = []
    for tp_size in (int(t) for t in args.tp.split(",")):
        runner = start_model_runner(tp_size, RunnerConfig(
            str(model), kv_slots=slots, max_requests=max(batches) + 1,
            context_len=max(args.context, args.prefill) + 8,
        ))  # fmt: skip
        try:
            clock = [0.0]
            _time_collectives(runner, clock)
            threads = torch.get_num_threads()
            for batch in batches:
                rows = _rows(runner, batch, args.context, first_slot=64)
                ids = [[11 + i] for i in range(batch)]
                prefix = [args.context - 1] * batch
                median, best, comm = _measure(runner, rows, prefix, ids, args.repeat, clock)
                results.append({"tp": tp_size, "threads_per_rank": threads, "work": "decode",
                                 "batch": batch, "median_ms": median * 1e3,
                                 "best_ms": best * 1e3, "collectives_ms": comm * 1e3})  # fmt: skip
                print(results[-1], flush=True)
                for row in rows:
                    runner.req_to_token_pool.free(row)
            (row,) = _rows(runner, 1, args.prefill, first_slot=64)
            prompt = [[11 + i % 1000 for i in range(args.prefill)]]
            repeat = max(3, args.repeat // 4)
            median, best, comm = _measure(runner, [row], [0], prompt, repeat, clock)
            results.append({"tp": tp_size, "threads_per_rank": threads, "work": "prefill",
                            "batch": args.prefill, "median_ms": median * 1e3,
                            "best_ms": best * 1e3, "collectives_ms": comm * 1e3})  # fmt: skip
            print(results[-1], flush=True)
        finally:
            runner.shutdown()
    print_table(
        ["tp", "threads/rank", "work", "batch (tokens)", "median ms", "best ms", "collectives ms"],
        [[r["tp"], r["threads_per_rank"], r["work"], r["batch"], round(r["median_ms"], 2),
          round(r["best_ms"], 2), round(r["collectives_ms"], 2)] for r in results],
    )  # fmt: skip
    write_json("tp_bench", {"preset": args.preset, "context": args.context,
                            "machine": machine(), "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
