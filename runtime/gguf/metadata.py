"""Read a GGUF file's header: the Hugging Face config its metadata describes, and an index of
its tensors (Hugging Face name, type, shape, byte range) that the weight reader maps later.

The ``gguf`` package parses the file; this module only maps llama.cpp's names onto the ones the
model classes load, and refuses by name whatever they cannot run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import ModelLoadError

# llama.cpp's architecture name -> (Hugging Face class, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# llama.cpp architectures near a supported one, named in the refusal.
REFUSED_VARIANTS = {
    "gemma": "Gemma 1",
    "gemma2": "Gemma 2 (attention and final logit softcapping)",
    "gemma3n": "Gemma 3n",
}
# Tensor types whose blocks the weight reader dequantizes (ggml's names).
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K",
)  # fmt: skip
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture names a layer tensor otherwise: Gemma 3's four norms a layer.
_ARCH_LAYER_TENSORS = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# llama.cpp's converter stores Gemma's norm weights w (the scale less one) as 1 + w.
_NORM_SHIFTED = ("gemma3",)
# Every Gemma 3 file's sixth layer is global, the others windowed (llama.cpp's rule too).
_GEMMA3_WINDOW_PATTERN = 6
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's Llama-3 RoPE divisors: folded into the config, not a parameter.
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: ``shape`` in torch order (rows first, the dequantized shape),
    its bytes at ``[offset, offset + nbytes)`` of the file. ``permute_heads``: rows to turn
    from llama.cpp's interleaved RoPE layout back to rotate-half, in this many heads (0: none).
    ``shift``: added to every value as it is read (-1 for a Gemma norm weight, stored as 1 + w
    by llama.cpp's converter, w in Hugging Face's checkpoints)."""

    hf_name: str
    gguf_name: str
    tensor_type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    permute_heads: int = 0
    shift: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "hf_name": self.hf_name,
            "gguf_name": self.gguf_name,
            "tensor_type": self.tensor_type,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "permute_heads": self.permute_heads,
            "shift": self.shift,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TensorEntry:
        return cls(**{**raw, "shape": tuple(raw["shape"])})


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself: ``config`` is a Hugging Face config.json's
    content, ``eos_token_ids`` what ends a turn, ``name`` the model's ``general.name``."""

    path: Path
    name: str
    architecture: str
    config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    tensors: tuple[TensorEntry, ...]


def read_header(path: Path) -> GGUFHeader:
    """Parse ``path`` (raising ModelLoadError naming the file and what is wrong with it)."""
    from runtime.gguf.reader import FastReader

    try:
        reader = FastReader(str(path))
    except Exception as exc:  # the gguf package raises ValueError, IndexError, struct errors
        raise ModelLoadError(f"{path}: not a readable GGUF file ({one_line(exc)})") from None
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        if arch in REFUSED_VARIANTS:
            raise ModelLoadError(
                f"{path}: {REFUSED_VARIANTS[arch]} is not supported (GGUF architecture "
                f"{arch!r}; supported: {supported})"
            )
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    size = path.stat().st_size
    for tensor in reader.tensors:
        _check_tensor(tensor, path, size)
    raw_tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(fields, arch, raw_tensors, path)
    tensors = tuple(_entry(t, arch, config, path) for t in reader.tensors if t.name != ROPE_FREQS)
    return GGUFHeader(
        path=path,
        name=str(fields.get("general.name") or path.stem),
        architecture=arch,
        config=config,
        eos_token_ids=_eos_ids(fields),
        tensors=tensors,
    )


class _Fields:
    """Typed access to the metadata, raising ModelLoadError for a missing required key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelLoadError(
                f"{self._path}: GGUF metadata {key!r} is unreadable ({one_line(exc)})"
            ) from None

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self._path}: GGUF metadata lacks {key!r}")
        return value


def _hf_config(fields: _Fields, arch: str, tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    hf_class, model_type = ARCHITECTURES[arch]
    heads = int(fields.need(f"{arch}.attention.head_count"))
    hidden = int(fields.need(f"{arch}.embedding_length"))
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{path}: GGUF file has no 'token_embd.weight' tensor")
    vocab = int(embedding.shape[-1])  # ggml lists dimensions innermost first
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    rope = _rope_parameters(fields, arch, tensors, path)
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": int(fields.need(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(fields.need(f"{arch}.feed_forward_length")),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 4096)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "dtype": _checkpoint_dtype(str(embedding.tensor_type.name)),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        config.update(_gemma3_config(fields, config, rope, path))
    return config


def _gemma3_config(
    fields: _Fields, config: dict[str, Any], rope: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Gemma 3's own keys, as transformers 5 writes them. The file stores the window and the
    global layers' RoPE; llama.cpp fixes the rest: every sixth layer global, base 10,000 on the
    windowed ones, scores scaled by head_dim ** -0.5, except for the 27B model (62 layers),
    whose scale is (hidden_size / heads) ** -0.5."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    if rope.get("rope_type") == "divisors":
        raise ModelLoadError(f"{path}: {ROPE_FREQS} in a Gemma 3 file is not supported")
    pattern = _GEMMA3_WINDOW_PATTERN
    return {
        "sliding_window": int(fields.need("gemma3.attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _rope_parameters(
    fields: _Fields, arch: str, tensors: dict[str, Any], path: Path
) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``: theta, and linear scaling or Llama 3's divisors
    (llama.cpp stores those as the ``rope_freqs`` tensor). YaRN and others are refused."""
    rope: dict[str, Any] = {"rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0))}
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor not in (None, 1.0):
        rope.update(rope_type="linear", factor=float(factor))
    elif kind not in ("none", "linear"):
        raise ModelLoadError(
            f"{path}: RoPE scaling {kind!r} is not supported (supported: none, linear, "
            "Llama 3 frequency factors)"
        )
    freqs = tensors.get(ROPE_FREQS)
    if freqs is not None:
        if str(freqs.tensor_type.name) != "F32":
            raise ModelLoadError(f"{path}: {ROPE_FREQS} must be F32")
        rope.update(rope_type="divisors", divisors=[float(x) for x in np.asarray(freqs.data)])
    rope.setdefault("rope_type", "default")
    return rope


def _check_tensor(tensor: Any, path: Path, file_size: int) -> None:
    """ModelLoadError for a tensor type no reader decodes, or bytes past the file's end."""
    kind = str(tensor.tensor_type.name)
    if kind not in TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has type {kind}, which is not supported "
            f"(supported: {', '.join(TENSOR_TYPES)})"
        )
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    if end > file_size:
        raise ModelLoadError(
            f"{path}: truncated: tensor {tensor.name!r} ends at byte {end}, the file has "
            f"{file_size}"
        )


def _entry(tensor: Any, arch: str, config: dict[str, Any], path: Path) -> TensorEntry:
    hf_name, permute = _hf_name(tensor.name, arch, config, path)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = str(tensor.tensor_type.name)
    offset, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
    shift = -1.0 if arch in _NORM_SHIFTED and tensor.name.endswith("norm.weight") else 0.0
    return TensorEntry(hf_name, tensor.name, kind, shape, offset, nbytes, permute, shift)


def _hf_name(name: str, arch: str, config: dict[str, Any], path: Path) -> tuple[str, int]:
    """The Hugging Face name of GGUF tensor ``name``, and how many heads its rows are
    permuted in (llama.cpp's converter interleaves Llama's q/k rows for its RoPE kernel)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], 0
    names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in names:
        raise ModelLoadError(f"{path}: tensor {name!r} has no counterpart in a {arch} model")
    layer, part, kind = match.groups()
    permute = 0
    if arch == "llama" and part == "attn_q":
        permute = config["num_attention_heads"]
    elif arch == "llama" and part == "attn_k":
        permute = config["num_key_value_heads"]
    return f"model.layers.{layer}.{names[part]}.{kind}", permute


def _eos_ids(fields: _Fields) -> tuple[int, ...]:
    """End-of-turn ids: EOS, and the end-of-turn / end-of-message tokens chat models add."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = fields.get(f"tokenizer.ggml.{key}")
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    return tuple(ids)


def _checkpoint_dtype(embedding_type: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16"}.get(embedding_type, "float16")


def one_line(exc: BaseException) -> str:
    """An exception's text on one line, cut to 300 characters, for a ModelLoadError."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
