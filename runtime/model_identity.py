"""A model's identity for caches that outlive the process: a hash of what decides its KV.

KV computed by one model is valid only for the same model: its config and its weights. Hashing
the weights themselves would read gigabytes at every start; their files' headers name every
tensor with its dtype, shape and place in the file, so a changed checkpoint changes its
headers in all but adversarial cases. A GGUF file's identity is its metadata (the config built
from it) and its tensor infos; a safetensors folder's, its config.json and each shard's header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from runtime.model_files import ModelFiles, checkpoint_files, locate_model

# safetensors files start with the header's length (u64, little endian), then the header JSON.
_MAX_HEADER_BYTES = 100 << 20


def model_identity(model_path: str | Path) -> str:
    """Hex SHA-256 over the model's config and its weight files' headers (not the weights)."""
    files = locate_model(model_path)
    digest = hashlib.sha256()
    digest.update(json.dumps(files.config(), sort_keys=True).encode())
    for part in _header_parts(files):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def _header_parts(files: ModelFiles) -> list[bytes]:
    if files.gguf is not None:
        return [repr(tensor).encode() for tensor in files.gguf.tensors]
    return [_safetensors_header(path) for path in checkpoint_files(files.path)]


def _safetensors_header(path: Path) -> bytes:
    """The header JSON of one safetensors file, as its bytes (a short or odd file: its size
    and name, which still tell a replaced file from the same one in all but odd cases)."""
    with open(path, "rb") as file:
        raw = file.read(8)
        if len(raw) == 8:
            (length,) = struct.unpack("<Q", raw)
            if length <= _MAX_HEADER_BYTES:
                return file.read(length)
    return f"{path.name}:{path.stat().st_size}".encode()
