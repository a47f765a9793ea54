"""Build a model from a Hugging Face folder: config.json plus one or many safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.model_config import ModelConfig
from runtime.models import CausalLM, get_model_class


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors shards of a folder, from its index when it has one."""
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path} (other formats are not supported)"
        )
    return files


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard, one tensor in memory at a time."""
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def load_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Instantiate the registered class for ``config.architecture`` and load its weights."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(config, dtype)
    model.load_weights(iter_checkpoint(config.model_path))
    return model.eval()
