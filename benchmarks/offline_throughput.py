"""Offline throughput: the Engine vs transformers' batched ``generate`` on the same model folder.

Workloads (seeded token ids, EOS ignored so every system produces the same number of tokens):
  shared-prefix: 64 requests = one 1024-token prefix + 64 unique tokens each, 32 output tokens;
  mixed:         64 independent prompts of 64-512 tokens, 32-128 output tokens each.
transformers runs what a user would write first: left-padded batches through ``generate``
(batches of --hf-batch, each generating its longest requested output; only requested tokens
count). Reports output tokens/s, the ratio, and our cache hit rate beside the optimal one.

    python -m benchmarks.offline_throughput [--preset small] [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_json
from benchmarks.suite.systems.model_source import load_hf_model
from runtime import Engine
from runtime.test_model import cached_test_model

Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)


def shared_prefix_workload(n: int, rng: random.Random, vocab: int) -> Workload:
    prefix = [rng.randrange(10, vocab) for _ in range(1024)]
    return [(prefix + [rng.randrange(10, vocab) for _ in range(64)], 32) for _ in range(n)]


def mixed_workload(n: int, rng: random.Random, vocab: int) -> Workload:
    return [
        ([rng.randrange(10, vocab) for _ in range(rng.randint(64, 512))], rng.randint(32, 128))
        for _ in range(n)
    ]


def optimal_hit_rate(workload: Workload) -> float:
    """Prompt tokens an ideal prefix cache serves: each prompt's longest common prefix with any
    earlier prompt, over all prompt tokens."""
    seen: list[list[int]] = []
    hits = total = 0
    for prompt, _ in workload:
        best = 0
        for other in seen:
            n = 0
            while n < min(len(prompt), len(other)) - 1 and prompt[n] == other[n]:
                n += 1
            best = max(best, n)
        hits += best
        total += len(prompt)
        seen.append(prompt)
    return hits / total


def run_engine(engine: Engine, workload: Workload) -> dict[str, Any]:
    engine.flush_cache()
    before = engine.get_server_info()
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for _, n in workload]
    start = time.perf_counter()
    results = engine.generate(input_ids=[p for p, _ in workload], sampling_params=params)
    seconds = time.perf_counter() - start
    after = engine.get_server_info()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    tokens = sum(len(r["output_ids"]) for r in results)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "cache_hit_rate": cached / prompt,
    }


def run_transformers(model: torch.nn.Module, workload: Workload, batch: int, pad: int) -> dict:
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(workload), batch):
        group = workload[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        new = max(n for _, n in group)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        tokens += sum(n for _, n in group)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="16 requests per workload")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = args.model_path or str(cached_test_model(args.preset, "llama"))
    n = 16 if args.quick else args.requests
    model = load_hf_model(path)
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id or 0
    rows = []
    with Engine(path, dtype="float32", max_total_tokens=64 * 1024) as engine:
        for name, make in (("shared-prefix", shared_prefix_workload), ("mixed", mixed_workload)):
            workload = make(n, random.Random(0), vocab)
            ours = run_engine(engine, workload)
            theirs = run_transformers(model, workload, args.hf_batch, pad)
            rows.append(
                {
                    "workload": name,
                    "requests": n,
                    "ours": ours,
                    "transformers": theirs,
                    "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                    "optimal_hit_rate": optimal_hit_rate(workload),
                }
            )
    print(f"\noffline_throughput: {path} (fp32, {torch.get_num_threads()} threads)\n")
    print_table(
        ["workload", "ours tok/s", "transformers tok/s", "ratio", "hit rate", "optimal hit"],
        [
            [
                r["workload"],
                r["ours"]["tokens_per_s"],
                r["transformers"]["tokens_per_s"],
                r["ratio"],
                r["ours"]["cache_hit_rate"],
                r["optimal_hit_rate"],
            ]
            for r in rows
        ],
    )
    write_json("offline_throughput", {"model_path": path, "results": rows}, args.out)


if __name__ == "__main__":
    main()
