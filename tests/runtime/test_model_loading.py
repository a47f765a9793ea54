"""Loading checkpoints: shards, dtypes, config variants, and clear errors for what we can't run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.models import supported_architectures
from tests.runtime.paged_driver import PagedDriver

PROMPT = [[11, 302, 57, 1999, 4, 88, 640, 73, 12]]


def _logits(path: Path, dtype: str = "float32") -> torch.Tensor:
    runner = ModelRunner(RunnerConfig(str(path), dtype=dtype, kv_slots=256, max_requests=2))
    driver = PagedDriver(runner)
    return driver.extend([driver.new_sequence()], PROMPT, logits="all")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_path: Path, tmp_path: Path):
    folder = _copy(tiny_model_path, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(_logits(folder), _logits(tiny_model_path), atol=0, rtol=0)


def test_unknown_architecture_is_named(tiny_model_path: Path, tmp_path: Path):
    folder = _copy(tiny_model_path, tmp_path / "unknown")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNetForCausalLM"):
        ModelRunner(RunnerConfig(str(folder), kv_slots=64))


def test_missing_weight_is_named(tiny_model_path: Path, tmp_path: Path):
    folder = _copy(tiny_model_path, tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        ModelRunner(RunnerConfig(str(folder), kv_slots=64))


def test_sliding_window_checkpoint_is_refused(tiny_model_path: Path, tmp_path: Path):
    folder = _copy(tiny_model_path, tmp_path / "mistral")
    config = json.loads((folder / "config.json").read_text())
    config |= {"architectures": ["MistralForCausalLM"], "sliding_window": 256}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window=256"):
        ModelConfig.from_pretrained(folder)


def test_old_style_rope_config_is_read(tiny_model_path: Path, tmp_path: Path):
    """Checkpoints saved by transformers 4.x carry rope_theta and rope_scaling at top level."""
    folder = _copy(tiny_model_path, tmp_path / "old")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    parsed = ModelConfig.from_pretrained(folder)
    assert parsed.rope_theta == 500000.0 and parsed.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(_logits(folder), _logits(tiny_model_path), atol=0, rtol=0)


def test_eos_ids_include_generation_config(tiny_model_path: Path):
    config = ModelConfig.from_pretrained(tiny_model_path)
    assert len(config.eos_token_ids) == 2  # <|endoftext|> and <|im_end|>


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_transformers(tiny_model_path: Path, dtype: str):
    ours = _logits(tiny_model_path, dtype)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(PROMPT)).logits[0].float()
    assert (ours - ref).abs().max() < 0.15
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.85


def test_registry_covers_the_llama_family():
    assert {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    } <= set(supported_architectures())
