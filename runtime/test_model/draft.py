"""Draft models for speculative decoding tests: a target truncated to its first decoder layers.

Two random-weight models agree only where they share weights, so the draft of a test model
keeps the target's embeddings, first ``num_layers`` decoder layers, final norm and lm_head, and
its tokenizer files: an early-exit copy of the target whose greedy tokens often match it. Works
for any Hugging Face Llama, Qwen2 or Qwen3 folder with safetensors weights.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from runtime.cache_dir import building, exclusive
from runtime.model_files import checkpoint_files
from runtime.model_loader import iter_checkpoint
from runtime.test_model.builder import default_cache_dir

# Bump when the folder contents change, so cached drafts are rebuilt.
DRAFT_BUILDER_VERSION = 1
# Files other than these configuration and tokenizer files stay behind (weights, docs).
_COPIED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "arbor_test_model.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MARKER = "arbor_draft_model.json"


def make_draft_model(target: str | Path, out: str | Path, num_layers: int = 1) -> Path:
    """Write at ``out`` (replacing it) the draft of the model folder ``target``: its first
    ``num_layers`` decoder layers, with the same embeddings, final norm, lm_head and tokenizer.
    Returns ``out``. Raises ValueError unless 1 <= num_layers < the target's layer count."""
    target, out = Path(target), Path(out)
    config = _read_config(target)
    _check_num_layers(target, config, num_layers)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    with building(out) as tmp:
        weights = {
            name: tensor.contiguous()
            for name, tensor in iter_checkpoint(target)
            if (m := _LAYER.match(name)) is None or int(m.group(1)) < num_layers
        }
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in sorted(target.iterdir()):
            if file.is_file() and file.suffix in _COPIED_SUFFIXES and file.name not in _NOT_COPIED:
                shutil.copy2(file, tmp / file.name)
        marker = {
            "target": str(target.resolve()),
            "target_fingerprint": _fingerprint(target),
            "num_layers": num_layers,
            "builder_version": DRAFT_BUILDER_VERSION,
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def cached_draft_model(target: str | Path, num_layers: int = 1) -> Path:
    """The draft of ``target`` under the cache dir, built once (safe across processes) and
    rebuilt when the folder of that name was built from other weights."""
    target = Path(target)
    _check_num_layers(target, _read_config(target), num_layers)
    root = default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{target.resolve().name}-draft-L{num_layers}"
    with exclusive(out):
        if not _is_draft_of(out, target):
            make_draft_model(target, out, num_layers)
    return out


def _read_config(target: Path) -> dict:
    config_file = target / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{config_file} not found: is {target} a Hugging Face model folder?")
    return json.loads(config_file.read_text())


def _check_num_layers(target: Path, config: dict, num_layers: int) -> None:
    total = config.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ValueError(f"{target / 'config.json'} has no num_hidden_layers")
    if not 1 <= num_layers < total:
        raise ValueError(
            f"num_layers must be between 1 and {total - 1} (the target {target} has {total} "
            f"decoder layers), got {num_layers}"
        )


def _fingerprint(target: Path) -> str:
    """Identifies the target's config and weight files (names, sizes, modification times)."""
    digest = hashlib.sha256((target / "config.json").read_bytes())
    for file in checkpoint_files(target):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()


def _is_draft_of(out: Path, target: Path) -> bool:
    marker = out / _MARKER
    if not marker.is_file():
        return False
    recorded = json.loads(marker.read_text())
    if recorded.get("builder_version") != DRAFT_BUILDER_VERSION:
        return False
    return recorded.get("target_fingerprint") == _fingerprint(target)
