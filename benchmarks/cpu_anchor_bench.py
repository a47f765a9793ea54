"""Arbor vs llama.cpp on the same weights: prefill and decode speed by batch size.

Arbor: the model runner alone (one packed forward per step, native kernels, oneDNN
projections): prefill of one ``--prompt-len`` prompt, and decode steps of B sequences at
context ``--prompt-len``. llama.cpp on the same float32 GGUF: llama-cpp-python for prefill and
batch-1 decode (one sequence, token by token), llama-server (``-np B``, continuous batching)
for B > 1, where the decode rate is the sum of the B slots' own rates as the server reports
them (``timings.predicted_per_second``) while all B decode together. Sampling is greedy.

    python -m benchmarks.cpu_anchor_bench [--preset qwen2.5-0.5b-shape] [--batches 1,8,32]
        [--prompt-len 128] [--steps 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import torch

import kernels
from benchmarks.common import best_time, print_table, write_json
from benchmarks.suite.systems.llama_cpp_baseline import converted
from benchmarks.suite.systems.llama_server_baseline import free_port
from benchmarks.suite.systems.llama_server_build import find_or_build
from benchmarks.suite.systems.llama_server_process import LlamaServer, ServerConfig
from runtime.model_runner import ModelRunner
from runtime.test_model import cached_test_model


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 8000), (batch, length), generator=gen).tolist()


def arbor(model: str, batches: list[int], prompt_len: int, steps: int) -> dict[str, float]:
    runner = ModelRunner(
        model, kv_slots=max(batches) * (prompt_len + steps + 8) + 1024,
        max_requests=max(batches), context_len=prompt_len + steps + 8,
    )  # fmt: skip
    vocab = runner.config.vocab_size
    result: dict[str, float] = {}
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(prompt_len))
    prompt = _prompts(1, prompt_len, vocab)[0]
    seconds = best_time(lambda: runner.forward(runner.build_batch([row], [0], [prompt])))
    result["prefill"] = prompt_len / seconds
    runner.req_to_token_pool.free(row)
    for batch in batches:
        rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
        span = prompt_len + steps
        for i, r in enumerate(rows):
            assert r is not None
            runner.req_to_token_pool.write(r, 0, torch.arange(i * span, (i + 1) * span))
        live = [r for r in rows if r is not None]
        prompts = _prompts(batch, prompt_len, vocab)
        logits = runner.forward(runner.build_batch(live, [0] * batch, prompts))

        def decode(first: torch.Tensor = logits, rows: list[int] = live) -> None:
            ids = first.argmax(-1).tolist()
            for step in range(steps):
                out = runner.forward(
                    runner.build_batch(rows, [prompt_len + step] * len(rows), [[t] for t in ids])
                )
                ids = out.argmax(-1).tolist()

        result[f"decode_b{batch}"] = batch * steps / best_time(decode, repeat=2)
        for r in live:
            runner.req_to_token_pool.free(r)
    return result


def llama_cpp(gguf: str, prompt_len: int, steps: int, vocab: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf, n_ctx=prompt_len + steps + 16, n_batch=max(512, prompt_len),
        n_threads=torch.get_num_threads(), verbose=False, logits_all=False,
    )  # fmt: skip
    prompt = _prompts(1, prompt_len, vocab)[0]

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    result = {"prefill": prompt_len / best_time(prefill)}

    def decode_seconds() -> float:
        """Seconds for ``steps`` greedy tokens after a fresh prefill (the prefill untimed)."""
        llm.reset()
        llm.eval(prompt)
        token = prompt[-1]
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = int(llm.scores[llm.n_tokens - 1].argmax())
        return time.perf_counter() - start

    best = min(decode_seconds() for _ in range(3))
    result["decode_b1"] = steps / best
    return result


def llama_server(gguf: str, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    config = ServerConfig(
        find_or_build(None), Path(gguf), batch, prompt_len + steps + 64,
        torch.get_num_threads(), free_port(),
    )  # fmt: skip

    async def run() -> float:
        prompts = _prompts(batch, prompt_len, vocab)
        async with httpx.AsyncClient(base_url=config.url, timeout=None) as client:
            body = {"n_predict": steps, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False}  # fmt: skip
            answers = await asyncio.gather(
                *(client.post("/completion", json={**body, "prompt": p}) for p in prompts)
            )
        rates = [a.json()["timings"]["predicted_per_second"] for a in answers]
        return float(sum(rates))

    with LlamaServer(config.command(), config.url):
        asyncio.run(run())  # warm-up
        return max(asyncio.run(run()) for _ in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b-shape")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = str(cached_test_model(args.preset, "llama"))
    kernels.set_kernel_backend("auto")
    ours = arbor(model, batches, args.prompt_len, args.steps)
    print("arbor", ours, flush=True)
    gguf = str(converted(model))
    vocab = _vocab(model)
    theirs = llama_cpp(gguf, args.prompt_len, args.steps, vocab)
    for batch in batches:
        if batch > 1:
            theirs[f"decode_b{batch}"] = llama_server(
                gguf, batch, args.prompt_len, args.steps, vocab
            )
    print("llama.cpp", theirs, flush=True)
    rows = [
        [key, round(ours[key], 1), round(theirs[key], 1), f"{ours[key] / theirs[key]:.2f}x"]
        for key in ours
    ]
    print_table(["tokens/s", "arbor", "llama.cpp", "arbor / llama.cpp"], rows)
    payload = {"preset": args.preset, "prompt_len": args.prompt_len, "steps": args.steps,
               "arbor": ours, "llama_cpp": theirs}  # fmt: skip
    write_json("cpu_anchor_bench", payload)


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    main()
