"""The built-in real model (SmolLM2-135M-Instruct, a Q4_1 GGUF) computed as transformers
computes it: greedy tokens on chat prompts from the GGUF and from a bf16 sharded checkpoint
written by ``save_pretrained``, the chat template, EOS, and DSL programs compiled and
interpreted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import frontend_lang as fl
import runtime
from frontend_lang.demo import travel_program
from runtime.model_files import builtin_model_path, load_tokenizer

NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Another one?"},
    ],
]
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS}


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(builtin_model_path())


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' own reading of the GGUF, dequantized to float32."""
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def backend(gguf_path: Path) -> Iterator[fl.Engine]:
    backend = fl.Engine(gguf_path, quantization="none", max_total_tokens=8192)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def engine(backend: fl.Engine) -> runtime.Engine:
    return backend.engine


def _prompts(tokenizer: Any) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]


def _hf_greedy(model: torch.nn.Module, tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return list(out[0, ids.shape[1] :].tolist())


def _assert_greedy_agrees(ours: list[list[int]], theirs: list[list[int]]) -> None:
    """All prompts agree on their first 8 tokens; all but one throughout (a near-tie between
    two float32 computations may flip one token, after which the texts part)."""
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(ours, theirs, strict=True)
    ]
    assert all(n >= min(8, len(y)) for n, y in zip(first_diff, theirs, strict=True)), first_diff
    assert sum(x == y for x, y in zip(ours, theirs, strict=True)) >= len(ours) - 1, first_diff


def test_greedy_tokens_equal_transformers_on_the_gguf(
    engine: runtime.Engine, hf_model: torch.nn.Module, hf_tokenizer: Any
) -> None:
    prompts = _prompts(hf_tokenizer)
    ours = [r["output_ids"] for r in engine.generate(prompts, GREEDY)]
    theirs = [_hf_greedy(hf_model, hf_tokenizer, p) for p in prompts]
    _assert_greedy_agrees(ours, theirs)
    assert "Paris" in engine.tokenizer.decode(ours[0])


def test_greedy_tokens_equal_transformers_on_a_bf16_sharded_checkpoint(
    hf_model: torch.nn.Module, hf_tokenizer: Any, tmp_path: Path
) -> None:
    """The folder a user downloads: bf16, sharded with an index, written by save_pretrained
    (a GGUF-loaded model refuses to save itself; a fresh model takes its weights)."""
    fresh = LlamaForCausalLM(hf_model.config)
    fresh.load_state_dict(hf_model.state_dict())
    folder = tmp_path / "smollm2-bf16"
    fresh.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100MB")
    hf_tokenizer.save_pretrained(folder)
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert (folder / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(hf_tokenizer)
    theirs = [_hf_greedy(reference, hf_tokenizer, p) for p in prompts]
    # float32 as the reference computes (auto would keep bfloat16 on a CPU with AVX512-BF16).
    engine = runtime.Engine(folder, dtype="float32", max_total_tokens=4096)
    try:
        ours = [r["output_ids"] for r in engine.generate(prompts, GREEDY)]
        # The chat template may sit in tokenizer_config.json instead of chat_template.jinja.
        template = (folder / "chat_template.jinja").read_text()
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        (folder / "chat_template.jinja").unlink()
        config_file.write_text(json.dumps({**config, "chat_template": template}))
        moved = load_tokenizer(folder)
        for messages in CONVERSATIONS:
            assert moved.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            ) == hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
    finally:
        engine.shutdown()
    _assert_greedy_agrees(ours, theirs)


def test_chat_template_renders_as_transformers(engine: runtime.Engine, hf_tokenizer: Any) -> None:
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            ours = engine.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            theirs = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours == theirs
            assert ours.endswith("<|im_start|>assistant\n") == generation_prompt


def test_generation_stops_at_eos_and_never_shows_it(engine: runtime.Engine) -> None:
    prompt = _prompts(engine.tokenizer)[0]
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"][-1] == eos and out["output_ids"].count(eos) == 1
    assert "<|im_end|>" not in out["text"] and out["text"].strip().endswith(".")


def test_compiled_and_interpreted_programs_give_equal_greedy_text(backend: fl.Engine) -> None:
    """The demo's program: a select, then a fork into two greedy branches."""
    travel = travel_program()
    interpreted = travel.run(city="Rome", backend=backend, compile=False)
    compiled = travel.run(city="Rome", backend=backend, compile=True)
    assert interpreted.text() == compiled.text()
    assert interpreted["continent"] == compiled["continent"] == "Europe"
    assert interpreted["fact"] == compiled["fact"] and len(compiled["fact"]) == 2
