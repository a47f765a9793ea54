"""Forward-pass speed: our paged model runner vs transformers on the same folder, same run.

Prefill: one 512-token prompt. Decode: B sequences of a 128-token prompt, 32 steps, at B = 1, 8,
32. Reports tokens/s and the ratio ours / transformers.

    python -m benchmarks.forward_bench [--preset small] [--quick]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.common import best_time, print_table, write_json
from benchmarks.suite.systems.model_source import load_hf_model
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.test_model import cached_test_model


def _ours_prefill(runner: ModelRunner, ids: list[int]) -> float:
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(len(ids)))
    seconds = best_time(lambda: runner.forward(runner.build_batch([row], [0], [ids])))
    runner.req_to_token_pool.free(row)
    return len(ids) / seconds


def _ours_decode(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> float:
    rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
    span = prompt_len + steps
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, torch.arange(i * span, (i + 1) * span))
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]

    def run() -> None:
        logits = runner.forward(runner.build_batch(rows, [0] * batch, prompts))
        for step in range(steps):
            next_ids = logits.argmax(-1).tolist()
            logits = runner.forward(
                runner.build_batch(rows, [prompt_len + step] * batch, [[t] for t in next_ids])
            )

    def prefill_only() -> None:
        runner.forward(runner.build_batch(rows, [0] * batch, prompts))

    seconds = best_time(run, repeat=2) - best_time(prefill_only, repeat=2)
    for row in rows:
        runner.req_to_token_pool.free(row)
    return batch * steps / seconds


def _hf_prefill(model: torch.nn.Module, ids: list[int]) -> float:
    inputs = torch.tensor([ids])
    with torch.no_grad():
        seconds = best_time(lambda: model(inputs, use_cache=True))
    return len(ids) / seconds


def _hf_decode(model: torch.nn.Module, batch: int, prompt_len: int, steps: int) -> float:
    prompts = torch.tensor(
        [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    )

    def run(decode: bool) -> None:
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            out = model(prompts, past_key_values=cache, use_cache=True)
            for _ in range(steps if decode else 0):
                next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(next_ids, past_key_values=out.past_key_values, use_cache=True)

    seconds = best_time(lambda: run(True), repeat=2) - best_time(lambda: run(False), repeat=2)
    return batch * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 only, 8 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = args.model_path or str(cached_test_model(args.preset, "llama"))
    batches = [1, 8] if args.quick else [1, 8, 32]
    steps = 8 if args.quick else 32
    runner = ModelRunner(RunnerConfig(path, dtype="float32", kv_slots=64 * 1024, max_requests=64))
    hf = load_hf_model(path)
    prompt = [(13 * j) % 1000 + 10 for j in range(512)]

    results: list[dict[str, Any]] = []
    ours, theirs = _ours_prefill(runner, prompt), _hf_prefill(hf, prompt)
    results.append({"metric": "prefill 512 tok", "ours": ours, "transformers": theirs})
    for batch in batches:
        ours = _ours_decode(runner, batch, 128, steps)
        theirs = _hf_decode(hf, batch, 128, steps)
        results.append({"metric": f"decode batch {batch}", "ours": ours, "transformers": theirs})
    for r in results:
        r["ratio"] = r["ours"] / r["transformers"]
    print(f"\nforward_bench: {path} (fp32, {torch.get_num_threads()} threads), tokens/s\n")
    print_table(
        ["metric", "ours tok/s", "transformers tok/s", "ratio"],
        [[r["metric"], r["ours"], r["transformers"], r["ratio"]] for r in results],
    )
    write_json("forward_bench", {"model_path": path, "results": results}, args.out)


if __name__ == "__main__":
    main()
