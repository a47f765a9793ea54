"""Local test models: a trained byte-level BPE tokenizer and seeded random weights."""

from runtime.test_model.builder import cached_test_model, default_cache_dir, make_test_model
from runtime.test_model.chat_templates import CHAT_TEMPLATES
from runtime.test_model.presets import ARCHITECTURES, PRESETS, Preset

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATES",
    "PRESETS",
    "Preset",
    "cached_test_model",
    "default_cache_dir",
    "make_test_model",
]
