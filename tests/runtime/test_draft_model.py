"""Draft models cut from a target: loadable by the runtime, the target's first layers and
tokenizer, agreeing with the target often enough to draft for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.test_model import cached_draft_model, make_draft_model, make_test_model
from tests.runtime.helpers import random_prompts


def test_draft_is_the_targets_first_layers(tiny_arch_model_path: Path, tmp_path: Path):
    draft = make_draft_model(tiny_arch_model_path, tmp_path / "draft", num_layers=2)
    assert ModelConfig.from_pretrained(draft).num_layers == 2
    runner = ModelRunner(RunnerConfig(str(draft), dtype="float32", kv_slots=256, max_requests=2))
    assert runner.config.num_layers == len(runner.model.model.layers) == 2
    target_weights = load_file(tiny_arch_model_path / "model.safetensors")
    draft_weights = load_file(draft / "model.safetensors")
    assert not any(name.startswith("model.layers.2.") for name in draft_weights)
    assert draft_weights.keys() < target_weights.keys()
    assert all(torch.equal(w, target_weights[name]) for name, w in draft_weights.items())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft / name).read_bytes() == (tiny_arch_model_path / name).read_bytes()
    assert (
        AutoTokenizer.from_pretrained(draft).get_vocab()
        == AutoTokenizer.from_pretrained(tiny_arch_model_path).get_vocab()
    )


def _agreement(target: Path, draft: Path) -> float:
    """How often the draft's greedy token equals the target's, along the target's greedy
    continuations of a few prompts (teacher-forced)."""
    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    draft_model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    matches = total = 0
    with torch.no_grad():
        for prompt in random_prompts([16, 8, 24, 12], seed=11):
            ids = target_model.generate(
                torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0]  # fmt: skip
            guesses = draft_model(ids[None]).logits[0, len(prompt) - 1 : -1].argmax(-1)
            matches += int((guesses == ids[len(prompt) :]).sum())
            total += ids.numel() - len(prompt)
    return matches / total


def test_draft_agrees_with_its_target_somewhere(tiny_arch_model_path: Path):
    draft = cached_draft_model(tiny_arch_model_path, num_layers=1)
    assert 0 < _agreement(tiny_arch_model_path, draft) < 1


def test_num_layers_must_leave_a_smaller_model(tiny_model_path: Path, tmp_path: Path):
    for bad in (0, 3, 7):
        with pytest.raises(ValueError, match=r"num_layers must be between 1 and 2 .* 3 decoder"):
            make_draft_model(tiny_model_path, tmp_path / "draft", num_layers=bad)
    with pytest.raises(ValueError, match="num_layers"):
        cached_draft_model(tiny_model_path, num_layers=0)
    assert not (tmp_path / "draft").exists()


def test_cached_draft_is_built_once_and_follows_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path / "cache"))
    target = make_test_model(tmp_path / "mymodel", "tiny", "qwen3", seed=1)
    draft = cached_draft_model(target)
    assert draft.name == "mymodel-draft-L1" and draft.parent == tmp_path / "cache" / "models"
    built = (draft / "model.safetensors").stat().st_mtime_ns
    assert cached_draft_model(target) == draft
    assert (draft / "model.safetensors").stat().st_mtime_ns == built
    make_test_model(target, "tiny", "qwen3", seed=2)  # same folder, other weights
    embed = load_file(cached_draft_model(target) / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(embed, load_file(target / "model.safetensors")["model.embed_tokens.weight"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", "make-test-model", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_makes_a_draft(tiny_model_path: Path, tmp_path: Path):
    result = _cli("--preset", "draft", "--target", str(tiny_model_path), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == tmp_path
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1
    refused = _cli("--preset", "draft", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "needs --target" in refused.stderr
    refused = _cli("--preset", "tiny", "--target", str(tiny_model_path))
    assert refused.returncode == 2 and "--preset draft only" in refused.stderr
    refused = _cli("--preset", "draft", "--target", str(tiny_model_path), "--num-layers", "3")
    assert refused.returncode == 2 and "between 1 and 2" in refused.stderr
