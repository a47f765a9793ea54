"""Prompts and reference outputs shared by the runtime tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def random_prompts(lengths: list[int], seed: int, vocab: int = 4000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.cache
def _hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, EOS ignored."""
    with torch.no_grad():
        out = _hf_model(str(path)).generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax of a direct forward: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(_hf_model(str(path))(torch.tensor([ids])).logits[0].float(), -1)
