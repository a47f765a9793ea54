"""Model implementations, found by the ``architectures`` name in config.json."""

from runtime.models import llama  # noqa: F401  (registers the Llama family)
from runtime.models.registry import get_model_class, register_model, supported_architectures

__all__ = ["get_model_class", "register_model", "supported_architectures"]
