"""Read a GGUF file's tensors as torch tensors under their Hugging Face names."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from arbor_kernels.quantized import BlockWeights

from runtime.errors import ModelLoadError
from runtime.gguf.blocks import BLOCK_TYPES, decode_blocks
from runtime.gguf.metadata import TensorEntry

logger = logging.getLogger(__name__)

# Types held as plain numbers: read as they lie, no block decoding.
_PLAIN = {"F32": np.float32, "F16": np.float16}


def iter_gguf_tensors(
    path: Path, entries: Iterable[TensorEntry], keep_blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockWeights]]:
    """Yield (Hugging Face name, tensor) for each entry, one tensor in memory at a time:
    plain types in their own dtype (F32, F16, BF16), quantized blocks dequantized to float32,
    Llama's q/k rows back in rotate-half order, Gemma's norm weights shifted back by
    ``TensorEntry.shift`` (in float32). With ``keep_blocks``, a quantized matrix of
    a type in ``BLOCK_TYPES`` comes as ``BlockWeights`` instead (its codes, not floats); any
    other quantized type is dequantized, and one warning names those tensors."""
    # A plain ndarray view: numpy runs memmap's Python hooks on every array derived from one.
    data = np.memmap(path, mode="r").view(np.ndarray)
    dequantized: list[str] = []
    for entry in entries:
        raw = data[entry.offset : entry.offset + entry.nbytes]
        blocks = keep_blocks and entry.tensor_type in BLOCK_TYPES and len(entry.shape) == 2
        if keep_blocks and not blocks and entry.tensor_type not in ("F32", "F16", "BF16"):
            dequantized.append(f"{entry.gguf_name} ({entry.tensor_type})")
        tensor: torch.Tensor | BlockWeights
        try:
            if blocks:
                n, k = entry.shape
                tensor = decode_blocks(raw, entry.tensor_type, (n, k))
            else:
                tensor = _decode(raw, entry)
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(
                f"{path}: tensor {entry.gguf_name!r} ({entry.tensor_type}) cannot be decoded: {exc}"
            ) from None
        if entry.permute_heads:
            if isinstance(tensor, BlockWeights):  # the same rows of codes, scales and offsets
                order = unpermute_rows(torch.arange(entry.shape[0]), entry.permute_heads)
                tensor = tensor.rows(order)
            else:
                tensor = unpermute_rows(tensor, entry.permute_heads)
        if entry.shift:  # a norm weight: one row, never kept as blocks
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor.float() + entry.shift
        yield entry.hf_name, tensor
    if dequantized:
        logger.warning(
            "%s: no quantized kernel runs these tensors' block types; they are dequantized to "
            "float: %s", path, ", ".join(dequantized),
        )  # fmt: skip


def _decode(raw: np.ndarray, entry: TensorEntry) -> torch.Tensor:
    if entry.tensor_type in _PLAIN:
        array = raw.view(_PLAIN[entry.tensor_type]).reshape(entry.shape)
        return torch.from_numpy(array.copy())
    if entry.tensor_type == "BF16":
        bits = torch.from_numpy(raw.view(np.int16).reshape(entry.shape).copy())
        return bits.view(torch.bfloat16)
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[entry.tensor_type]
    rows = int(np.prod(entry.shape[:-1], dtype=np.int64))
    blocks = raw.reshape(rows, -1)
    values = quants.dequantize(blocks, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(entry.shape))


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, its converter moved row pairs
    (i, i + d/2) of rotate-half RoPE next to each other (rows 2i, 2i + 1) for interleaved
    RoPE. Works on weights [heads * d, in] and biases [heads * d]."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return (
        weight.reshape(heads, half, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )
