"""Build a model from its files: a Hugging Face folder (config.json plus one or many
safetensors shards) or a GGUF file (runtime/model_files.py says which)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from arbor_kernels.dispatch import runs_natively

from runtime.distributed.group import SINGLE, TPGroup
from runtime.errors import ModelLoadError
from runtime.model_config import ModelConfig
from runtime.model_files import iter_checkpoint_slices, locate_model
from runtime.models import CausalLM, get_model_class
from runtime.server_args import QUANTIZATIONS

logger = logging.getLogger(__name__)


def iter_checkpoint(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every shard, one tensor in memory at a time."""
    for name, tensor in iter_checkpoint_slices(model_path):
        yield name, tensor[:]


def resolve_quantization(
    quantization: str, gguf_file: bool = False, device: str = "cpu", tp_size: int = 1
) -> str:
    """The weight format ``quantization`` names for a model (a GGUF file or not) on
    ``device`` across ``tp_size`` ranks: ``gguf`` keeps a GGUF file's quantized blocks and
    runs them in the quantized kernels; ``none`` dequantizes them to the compute dtype at load.
    ``auto`` is ``gguf`` for a GGUF file on CPU on one rank where the native quantized kernels
    run (without them the torch reference would dequantize every weight on every call), else
    ``none``. An asked-for
    ``gguf`` where no quantized kernels run (a GPU, tensor parallelism) is ``none``, with a
    warning; a model without blocks (a Hugging Face folder) has nothing to keep: ``none``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}"
        )
    cpu = torch.device(device).type == "cpu"
    if quantization == "auto":
        if not (gguf_file and cpu and tp_size == 1):
            return "none"
        if not runs_natively("quantized_linear", torch.device("cpu")):
            logger.warning(
                "quantization auto: the native CPU kernels are not built (make install), so "
                "the GGUF weights are dequantized (quantization none)"
            )
            return "none"
        return "gguf"
    if quantization == "gguf" and gguf_file and not (cpu and tp_size == 1):
        where = f"device {device}" if not cpu else f"tensor parallelism ({tp_size} ranks)"
        logger.warning(
            "quantization gguf: no quantized kernels for %s; the GGUF weights are dequantized "
            "(quantization none)", where,
        )  # fmt: skip
        return "none"
    return quantization if gguf_file else "none"


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
    quantization: str = "none",
) -> CausalLM:
    """Instantiate the registered class for ``config.architecture`` and load its weights (as
    rank ``tp.rank`` of a tensor-parallel group: only that rank's shards are read and held).
    ``quantization`` is a resolved one (``resolve_quantization``): ``gguf`` keeps a GGUF
    file's blocks in quantized layers, ``none`` dequantizes them."""
    model_cls = get_model_class(config.architecture)
    with torch.device(device):
        model = model_cls(config, dtype, tp)
    try:
        keep_blocks = quantization == "gguf"
        model.load_weights(locate_model(config.model_path).iter_weights(keep_blocks))
    except ModelLoadError:
        raise
    except (ValueError, OSError, RuntimeError) as exc:  # shapes, names, unreadable shards
        raise ModelLoadError(f"{config.model_path}: {exc}") from None
    return model.eval()
