"""Model implementations, found by the ``architectures`` name in config.json."""

from runtime.models.registry import CausalLM, get_model_class, supported_architectures

__all__ = ["CausalLM", "get_model_class", "supported_architectures"]
