"""``arbor demo``: load a model in-process and generate greedily from a prompt."""

from __future__ import annotations

import time

import torch
from transformers import AutoTokenizer

from runtime.model_runner import ModelRunner
from runtime.test_model import cached_test_model


def run_demo(model_path: str | None, prompt: str, max_new_tokens: int) -> int:
    path = model_path or str(cached_test_model("tiny", "llama"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    runner = ModelRunner(path, kv_slots=4096, max_requests=4)
    ids = tokenizer(prompt).input_ids
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    total = len(ids) + max_new_tokens
    runner.req_to_token_pool.write(row, 0, torch.arange(total))
    start = time.perf_counter()
    new_ids: list[int] = []
    step_ids, prefix = ids, 0
    for _ in range(max_new_tokens):
        logits = runner.forward(runner.build_batch([row], [prefix], [step_ids]))
        prefix += len(step_ids)
        step_ids = [int(logits[0].argmax())]
        new_ids += step_ids
    elapsed = time.perf_counter() - start
    print(f"model: {path}")
    print(f"prompt: {prompt!r}")
    print(f"completion: {tokenizer.decode(new_ids)!r}")
    print(f"{len(new_ids)} tokens in {elapsed:.3f} s")
    return 0
