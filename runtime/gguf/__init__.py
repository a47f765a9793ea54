"""GGUF files (llama.cpp's format) as models: their config, tokenizer and weights.

Reading a file's header and converting its config and tokenizer (``open_gguf``) imports no
torch, so the server's HTTP and detokenizer processes can locate a GGUF model for its
tokenizer; the weights' names load torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports
from runtime.gguf.metadata import ARCHITECTURES, TENSOR_TYPES, TensorEntry
from runtime.gguf.sidecar import GGUFModel, open_gguf

if TYPE_CHECKING:
    from runtime.gguf.weights import iter_gguf_tensors, unpermute_rows

__all__, __getattr__ = lazy_exports(__name__)
