"""GGUF files for tests, written from the tiny test models with the benchmarks' exporter, and
the Hugging Face folder each one's weights stand for (its oracle)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from benchmarks.suite.systems.gguf_export import export_gguf


def write_gguf(model_dir: Path, out: Path, tensor_type: str = "F32") -> Path:
    return export_gguf(model_dir, out, tensor_type)


def reference_folder(model_dir: Path, out: Path, tensor_type: str) -> Path:
    """``model_dir`` with each matrix the exporter writes in ``tensor_type`` replaced by its
    quantize-dequantize round trip: the weights a GGUF of that type holds, in Hugging Face's
    layout (block formats quantize along rows, so llama.cpp's q/k row permutation commutes
    with them). Norms and biases stay float32, as the exporter keeps them."""
    out.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, out / file.name)
    kind = gguf.GGMLQuantizationType[tensor_type]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, tensor in tensors.items():
            array = tensor.float().numpy()
            if array.ndim == 2 and array.shape[1] % block == 0:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)
                tensors[name] = torch.from_numpy(np.ascontiguousarray(rounded, np.float32))
            else:
                tensors[name] = tensor.float()
        save_file(tensors, str(out / shard.name))
    return out
