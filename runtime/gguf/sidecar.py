"""A GGUF file's Hugging Face side: the folder of config.json, generation_config.json,
tokenizer and chat template files that everything reading a model folder reads, plus the
tensor index (``arbor_gguf.json``), built once per file under the cache dir.

The weights stay in the GGUF file; the folder is a few MB. Building it parses the file and
converts its tokenizer with transformers (seconds); every later process of every later run
reads the folder instead (a server's three processes, replicas, the DSL's engine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.cache_dir import building, cache_root, exclusive
from runtime.errors import ModelLoadError
from runtime.gguf.metadata import GGUFHeader, TensorEntry, one_line, read_header

logger = logging.getLogger(__name__)

# Bump when the folder's contents change, so older folders are rebuilt.
SIDECAR_VERSION = 1
INDEX_FILE = "arbor_gguf.json"


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file and its built folder: ``folder`` holds the config and tokenizer,
    ``tensors`` index the file's weights, ``name`` is its ``general.name``."""

    path: Path
    folder: Path
    name: str
    tensors: tuple[TensorEntry, ...]


def open_gguf(path: Path) -> GGUFModel:
    """The folder for GGUF ``path``, built if no process has built it for this file (its
    resolved path, size and modification time) yet; ModelLoadError for a file that is not one
    this runtime can serve."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(
        f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{SIDECAR_VERSION}".encode()
    ).hexdigest()[:16]
    folder = cache_root() / "gguf-converted" / f"{path.stem}-{key}"
    with exclusive(folder):
        if not (folder / INDEX_FILE).is_file():
            _build(path, folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    return GGUFModel(
        path=path,
        folder=folder,
        name=index["name"],
        tensors=tuple(TensorEntry.from_json(t) for t in index["tensors"]),
    )


def _build(path: Path, folder: Path) -> None:
    started = time.perf_counter()
    header = read_header(path)
    with building(folder) as tmp:
        _save_tokenizer(path, tmp)
        (tmp / "config.json").write_text(json.dumps(header.config, indent=2))
        generation = {"bos_token_id": header.config["bos_token_id"]}
        generation["eos_token_id"] = list(header.eos_token_ids)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (tmp / INDEX_FILE).write_text(json.dumps(_index(header)))
    logger.info("read %s into %s in %.1f s", path, folder, time.perf_counter() - started)


def _save_tokenizer(path: Path, folder: Path) -> None:
    """transformers' GGUF tokenizer conversion (BPE and SentencePiece vocabularies, special
    tokens, whether BOS is added, the chat template), saved as tokenizer.json & co."""
    from transformers import AutoTokenizer

    from runtime.gguf.reader import fast_gguf_reader

    try:
        with fast_gguf_reader():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many kinds for what it cannot convert
        raise ModelLoadError(
            f"{path}: its tokenizer cannot be converted ({one_line(exc)})"
        ) from None
    tokenizer.save_pretrained(str(folder))


def _index(header: GGUFHeader) -> dict[str, Any]:
    return {
        "version": SIDECAR_VERSION,
        "source": str(header.path),
        "name": header.name,
        "architecture": header.architecture,
        "tensors": [t.to_json() for t in header.tensors],
    }
