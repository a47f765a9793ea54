"""What ``--deterministic`` costs: one model runner per mode on the built-in model (or
``--model``), measured alternately in the same run, best of ``--repeat`` rounds.

Prefill: one prompt of ``--prefill-len`` tokens. Decode: one sequence, ``--steps`` greedy steps
after a prompt of 16 tokens and after one of ``--prefill-len`` (past 512 keys the default
decode attention splits a single sequence over threads; deterministic mode does not).

    python -m benchmarks.deterministic_bench [--model PATH] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import arbor_kernels as kernels
import torch

from benchmarks.common import print_table, write_json
from runtime.model_files import builtin_model_path
from runtime.model_runner import ModelRunner, RunnerConfig


def _prefill_seconds(runner: ModelRunner, ids: list[int]) -> float:
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(1, len(ids) + 1))
    start = time.perf_counter()
    runner.forward(runner.build_batch([row], [0], [ids]))
    seconds = time.perf_counter() - start
    runner.req_to_token_pool.free(row)
    return seconds


def _decode_seconds(runner: ModelRunner, prompt: list[int], steps: int) -> float:
    """Seconds per greedy decode step of one sequence after ``prompt``."""
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(1, len(prompt) + steps + 1))
    logits = runner.forward(runner.build_batch([row], [0], [prompt]))
    start = time.perf_counter()
    for step in range(steps):
        token = int(logits.argmax(-1)[0])
        logits = runner.forward(runner.build_batch([row], [len(prompt) + step], [[token]]))
    seconds = (time.perf_counter() - start) / steps
    runner.req_to_token_pool.free(row)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    path = args.model or builtin_model_path()
    runners = {
        mode: ModelRunner(RunnerConfig(path, kv_slots=4096, max_requests=4, deterministic=mode))
        for mode in (False, True)
    }
    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(10, 20000, (args.prefill_len,), generator=gen).tolist()
    short_prompt = long_prompt[:16]
    best: dict[tuple[bool, str], float] = {}
    for _ in range(args.repeat):
        for mode, runner in runners.items():
            kernels.set_deterministic(mode)  # process-wide: the runner built last set it
            times = {
                "prefill": _prefill_seconds(runner, long_prompt) / args.prefill_len,
                "decode, context 16": _decode_seconds(runner, short_prompt, args.steps),
                f"decode, context {args.prefill_len}": _decode_seconds(
                    runner, long_prompt, args.steps
                ),
            }
            for name, seconds in times.items():
                key = (mode, name)
                best[key] = min(best.get(key, float("inf")), seconds)
    rows = []
    for name in dict.fromkeys(name for _, name in best):
        default, fixed = 1 / best[False, name], 1 / best[True, name]
        rows.append([name, f"{default:.1f}", f"{fixed:.1f}", f"{fixed / default - 1:+.1%}"])
    print_table(["tok/s", "default", "--deterministic", "change"], rows)
    write_json("deterministic_bench", {"model": str(path), "rows": rows})


if __name__ == "__main__":
    main()
