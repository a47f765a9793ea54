"""Build a model from its files: a Hugging Face folder (config.json plus one or many
safetensors shards) or a GGUF file (runtime/model_files.py says which)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.distributed.group import SINGLE, TPGroup
from runtime.errors import ModelLoadError
from runtime.model_config import ModelConfig
from runtime.model_files import iter_checkpoint_slices, locate_model
from runtime.models import CausalLM, get_model_class
from runtime.server_args import QUANTIZATIONS


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard, one tensor in memory at a time."""
    for name, tensor in iter_checkpoint_slices(model_path):
        yield name, tensor[:]


def resolve_quantization(quantization: str) -> str:
    """The weight format ``quantization`` names: ``none`` (dequantized to the compute dtype)
    for both values until quantized kernels exist."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}"
        )
    return "none"


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE
) -> CausalLM:
    """Instantiate the registered class for ``config.architecture`` and load its weights (as
    rank ``tp.rank`` of a tensor-parallel group: only that rank's shards are read and held)."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(config, dtype, tp)
    try:
        model.load_weights(locate_model(config.model_path).iter_weights())
    except ModelLoadError:
        raise
    except (ValueError, OSError, RuntimeError) as exc:  # shapes, names, unreadable shards
        raise ModelLoadError(f"{config.model_path}: {exc}") from None
    return model.eval()
