"""Local test models: a trained byte-level BPE tokenizer and seeded random weights, and draft
models for speculative decoding cut from any model folder.

The builder loads on first use, so the ``arbor`` command line can offer the presets and
templates without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazy_exports import lazy_exports
from runtime.test_model.chat_templates import CHAT_TEMPLATES
from runtime.test_model.presets import ARCHITECTURES, PRESETS, Preset

if TYPE_CHECKING:
    from runtime.test_model.builder import cached_test_model, default_cache_dir, make_test_model
    from runtime.test_model.draft import cached_draft_model, make_draft_model

__all__, __getattr__ = lazy_exports(__name__)  # the names under TYPE_CHECKING import torch
