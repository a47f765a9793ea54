"""Maps ``architectures`` names from config.json to model classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_MODELS: dict[str, type[torch.nn.Module]] = {}
M = TypeVar("M", bound=type[torch.nn.Module])


def register_model(*architectures: str) -> Callable[[M], M]:
    def wrap(cls: M) -> M:
        for name in architectures:
            _MODELS[name] = cls
        return cls

    return wrap


def get_model_class(architecture: str) -> type[torch.nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        supported = ", ".join(sorted(_MODELS))
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported}"
        ) from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
