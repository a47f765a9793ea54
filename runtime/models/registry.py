"""Maps ``architectures`` names from config.json to model classes."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from runtime.layers.basic import Linear
from runtime.model_files import MODEL_CLASSES

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch


class CausalLM(torch.nn.Module, ABC):
    """What the runner needs of a model: ``cls(config: ModelConfig, dtype, tp: TPGroup)``
    builds it on the current default device as rank ``tp.rank`` of a tensor-parallel group
    (``runtime.distributed.SINGLE``: the whole model), ``load_weights`` fills it from
    checkpoint tensors, ``forward`` runs a packed batch."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (Hugging Face names; torch tensors or safetensors slices,
        which index alike) into the parameters, or this rank's shards of them."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [N, vocab] float32 for the packed rows ``batch.logit_indices`` (on the other
        ranks of a tensor-parallel group: their own block of the vocabulary's logits)."""

    def pack_weights(self) -> None:
        """After loading, for serving: move projection weights into the fastest layout the
        device has (oneDNN's on CPU, float32 or bfloat16: ``Linear.pack``). Weights can no
        longer be loaded afterwards."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class that runs ``architecture`` (``runtime.model_files.MODEL_CLASSES``)."""
    where = MODEL_CLASSES.get(architecture)
    if where is None:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported}")
    module, name = where.split(":")
    return cast(type[CausalLM], getattr(importlib.import_module(module), name))


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)
