"""The model each system loads for a benchmark's ``--model-path``: a Hugging Face folder or a
GGUF file.

Arbor takes either (runtime/model_files.py), and so does every tokenizer here
(``runtime.model_files.load_tokenizer``). transformers loads a folder as it is and a GGUF file
with ``gguf_file=`` (dequantized to float32, as Arbor runs it on CPU). transformers 5.x reads
less of a GGUF file's metadata than Arbor does: it drops Llama 3 RoPE scaling (the
``rope_freqs`` tensor) and Qwen3's head_dim, so such a file is refused (UnsupportedModel) rather
than run as a different model. llama.cpp runs a GGUF file as it is, and a folder through a
float32 conversion (gguf_export.py), made once and cached.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from benchmarks.suite.systems.gguf_export import UnsupportedModel, export_gguf
from runtime.cache_dir import cache_root
from runtime.model_files import locate_model


def gguf_file(model_path: str) -> Path | None:
    """The GGUF file ``model_path`` is, or None for a folder."""
    files = locate_model(model_path)
    return files.gguf.path if files.gguf is not None else None


def llama_cpp_file(model_path: str) -> Path:
    """The file llama.cpp runs: the GGUF file itself, or the folder's float32 conversion."""
    return gguf_file(model_path) or converted(model_path)


def converted(model_path: str) -> Path:
    """The folder's GGUF, converted once and cached by the folder's config and weight files."""
    folder = Path(model_path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache_root() / "gguf" / f"{folder.name}-{digest.hexdigest()[:12]}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        export_gguf(folder, partial)
        partial.rename(out)
    return out


def load_hf_model(model_path: str) -> Any:
    """``AutoModelForCausalLM`` in float32, in eval mode, from a folder or a GGUF file
    (UnsupportedModel for a GGUF file transformers would read as another model)."""
    from transformers import AutoModelForCausalLM

    path = gguf_file(model_path)
    if path is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except (ValueError, RuntimeError) as exc:  # e.g. weights of another shape than its config
        raise UnsupportedModel(f"transformers cannot load {path}: {exc}") from None
    differs = _misread(model.config, locate_model(model_path).config())
    if differs:
        raise UnsupportedModel(f"transformers reads {path} as another model: {differs}")
    return model.eval()


def _misread(hf: Any, ours: dict[str, Any]) -> str:
    """The fields where transformers' config of a GGUF file differs from Arbor's, which reads
    all of the file's metadata ('' when none do)."""
    heads = ours["num_attention_heads"]
    hf_rope = getattr(hf, "rope_parameters", None) or {}
    wanted = {
        "head_dim": ours.get("head_dim") or ours["hidden_size"] // heads,
        "num_key_value_heads": ours.get("num_key_value_heads") or heads,
        "rope_type": (ours.get("rope_parameters") or {}).get("rope_type", "default"),
    }
    got = {
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads or hf.num_attention_heads,
        "rope_type": hf_rope.get("rope_type", "default"),
    }
    return ", ".join(
        f"{key} {got[key]!r}, not {wanted[key]!r}" for key in wanted if got[key] != wanted[key]
    )


def context_length(model_path: str) -> int:
    """The model's ``max_position_embeddings`` (4096 when its config has none)."""
    return int(locate_model(model_path).config().get("max_position_embeddings", 4096))
