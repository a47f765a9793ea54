"""GGUF files (llama.cpp's format) as models: their config, tokenizer and weights."""

from __future__ import annotations

from runtime.gguf.metadata import ARCHITECTURES, TENSOR_TYPES, TensorEntry
from runtime.gguf.sidecar import GGUFModel, open_gguf
from runtime.gguf.weights import iter_gguf_tensors, unpermute_rows

__all__ = [
    "ARCHITECTURES",
    "TENSOR_TYPES",
    "GGUFModel",
    "TensorEntry",
    "iter_gguf_tensors",
    "open_gguf",
    "unpermute_rows",
]
