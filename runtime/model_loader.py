"""Build a model from a Hugging Face folder: config.json plus one or many safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runtime.distributed.group import SINGLE, TPGroup
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
    for name, tensor in iter_checkpoint_slices(model_path):
        yield name, tensor[:]


def iter_checkpoint_slices(model_path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, safetensors slice) for every tensor of every shard: indexing a slice like a
    tensor (``s[a:b]``, ``s[:, a:b]``, ``s[:]``) reads only those bytes from the file."""
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_slice(name)


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE
) -> CausalLM:
    """Instantiate the registered class for ``config.architecture`` and load its weights (as
    rank ``tp.rank`` of a tensor-parallel group: only that rank's shards are read and held)."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(config, dtype, tp)
    model.load_weights(iter_checkpoint_slices(config.model_path))
    return model.eval()
