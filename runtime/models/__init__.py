"""Model implementations, found by the ``architectures`` name in config.json."""

from runtime.models import llama  # noqa: F401  (registers the Llama family)
from runtime.models.registry import (
    CausalLM,
    get_model_class,
    register_model,
    supported_architectures,
)

__all__ = ["CausalLM", "get_model_class", "register_model", "supported_architectures"]
