"""Local test models: a trained byte-level BPE tokenizer and seeded random weights.

The builder loads on first use, so the ``arbor`` command line can offer the presets and
templates without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from runtime.test_model.chat_templates import CHAT_TEMPLATES
from runtime.test_model.presets import ARCHITECTURES, PRESETS, Preset

if TYPE_CHECKING:
    from runtime.test_model.builder import cached_test_model, default_cache_dir, make_test_model

_BUILDER_NAMES = ("cached_test_model", "default_cache_dir", "make_test_model")

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATES",
    "PRESETS",
    "Preset",
    "cached_test_model",
    "default_cache_dir",
    "make_test_model",
]


def __getattr__(name: str) -> Any:
    if name not in _BUILDER_NAMES:
        raise AttributeError(f"module 'runtime.test_model' has no attribute {name!r}")
    value = getattr(importlib.import_module("runtime.test_model.builder"), name)
    globals()[name] = value
    return value
