"""The ``gguf`` package's reader, minus a cost: it maps the file as an ``np.memmap``, and numpy
runs memmap's Python hooks on each of the ~10^6 small arrays a header's tokenizer makes (98k
tokens and merges for SmolLM2): 2.3 s to parse, 0.75 s on a plain ndarray view of the same
mapping. transformers' GGUF tokenizer conversion parses the file with the same class."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np


class FastReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` on a plain ndarray view of its read-only mapping (same fields,
    same tensors)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = mapped.view(np.ndarray)


@contextlib.contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """Inside, ``gguf.GGUFReader`` is ``FastReader`` for whoever imports it (transformers'
    ``load_gguf_checkpoint`` does, when it is called). Not for concurrent use."""
    original: Any = gguf.GGUFReader
    gguf.GGUFReader = FastReader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
