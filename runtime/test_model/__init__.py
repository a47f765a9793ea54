"""Local test models: a trained byte-level BPE tokenizer and seeded random weights."""

from runtime.test_model.builder import cached_test_model, default_cache_dir, make_test_model
from runtime.test_model.presets import ARCHITECTURES, PRESETS, Preset
from runtime.test_model.tokenizer import CHAT_TEMPLATE_NAMES

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE_NAMES",
    "PRESETS",
    "Preset",
    "cached_test_model",
    "default_cache_dir",
    "make_test_model",
]
