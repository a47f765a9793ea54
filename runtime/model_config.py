"""What the runtime needs to know about a checkpoint, read from its Hugging Face config (a
GGUF file's is converted into one: runtime/model_files.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import ModelLoadError
from runtime.model_files import locate_model

if TYPE_CHECKING:
    import torch

GEMMA3 = "Gemma3ForCausalLM"
# What runtime.layers.rotary computes; divisors: Llama 3's scaling as a GGUF file stores it.
ROPE_TYPES = ("default", "linear", "llama3", "divisors")
# The dtypes a checkpoint is stored in and a model computes in, with their sizes in bytes (by
# name: the server's HTTP process reads configs without importing torch).
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder: the Llama family (Llama, Mistral, Qwen2,
    Qwen3) and Gemma 3. The fields after ``eos_token_ids`` are Gemma 3's (``gemma3_fields``);
    the Llama family leaves them at their defaults."""

    model_path: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    checkpoint_dtype: str  # a name in _DTYPES
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Each layer's attention window in tokens (0: the whole sequence); empty: all global.
    layer_windows: tuple[int, ...] = ()
    # The windowed layers' RoPE base and scaling (``rope_theta``, ``rope_scaling``: the others').
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None

    def window(self, layer: int) -> int:
        """Layer ``layer``'s attention window (0: none)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V over all layers for one token, in the checkpoint dtype."""
        elem = _DTYPES[self.checkpoint_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def from_pretrained(cls, model_path: str | Path) -> ModelConfig:
        """The config of a Hugging Face folder or a GGUF file; ModelLoadError for neither, and
        for what the model classes cannot run (sliding windows, other RoPE scalings)."""
        files = locate_model(model_path)
        path = files.config_dir
        config_file = path / "config.json"
        raw = files.config()
        window = raw.get("sliding_window")
        max_pos = raw.get("max_position_embeddings", 4096)
        gemma3 = raw["architectures"][0] == GEMMA3
        # Qwen configs carry a window with use_sliding_window false; a window at least as long
        # as the context is full attention.
        if not gemma3 and window and raw.get("use_sliding_window", True) and window < max_pos:
            raise ModelLoadError(
                f"{path}: sliding-window attention (sliding_window={window}) is not supported"
            )
        extra = gemma3_fields(raw, config_file) if gemma3 else {}
        rope = extra.pop("rope", None) or _rope_parameters(raw)
        kind = rope.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ModelLoadError(
                f"{config_file}: RoPE scaling {kind!r} is not supported (supported: "
                f"{', '.join(ROPE_TYPES)})"
            )
        heads = raw["num_attention_heads"]
        return cls(
            model_path=str(files.path),
            architecture=raw["architectures"][0],
            model_type=raw.get("model_type", ""),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.pop("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            checkpoint_dtype=stored_dtype(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(path, raw),
            **extra,
        )


def gemma3_fields(raw: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """Gemma 3's ``ModelConfig`` fields from its text config, and under ``rope`` the global
    layers' RoPE parameters. ModelLoadError, naming the variant, for what Gemma3ForCausalLM does
    not run: a vision tower, bidirectional attention (EmbeddingGemma), logit softcapping.

    Layer i is windowed when ``layer_types[i]`` is ``sliding_attention``; without
    ``layer_types``, every ``sliding_window_pattern``-th layer (default 6) is global. RoPE comes
    as transformers 5 writes it (``rope_parameters`` per layer type) or as 4.x did
    (``rope_theta`` and ``rope_scaling`` for global layers, ``rope_local_base_freq``)."""
    if raw.get("vision_config") is not None or "text_config" in raw:
        raise ModelLoadError(
            f"{config_file}: Gemma 3 with a vision tower (a multimodal config: text_config, "
            "vision_config) is not supported; its text-only model is"
        )
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{config_file}: Gemma 3 with bidirectional attention (EmbeddingGemma) is not supported"
        )
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{config_file}: Gemma 3 with activation {activation!r} is not supported"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{config_file}: Gemma 3 with {key} is not supported")
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if len(types) != layers or unknown:
        raise ModelLoadError(f"{config_file}: layer_types {types} do not fit {layers} layers")
    window = int(raw.get("sliding_window") or 0)
    if window <= 0 and "sliding_attention" in types:
        raise ModelLoadError(f"{config_file}: sliding_attention layers need a sliding_window")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        global_rope = dict(params.get("full_attention") or {})
        local_rope = dict(params.get("sliding_attention") or {})
    else:
        global_rope = {"rope_theta": raw.get("rope_theta", 1_000_000.0)}
        global_rope.update(raw.get("rope_scaling") or {})
        local_rope = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    global_rope.setdefault("rope_theta", 1_000_000.0)
    local_theta = float(local_rope.pop("rope_theta", 10_000.0))
    for rope in (global_rope, local_rope):
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        kind = rope.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ModelLoadError(
                f"{config_file}: RoPE scaling {kind!r} is not supported (supported: "
                f"{', '.join(ROPE_TYPES)})"
            )
    return {
        "rope": global_rope,
        "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
        "local_rope_theta": local_theta,
        "local_rope_scaling": (
            local_rope if local_rope.get("rope_type", "default") != "default" else None
        ),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
    }


def stored_dtype(raw: dict[str, Any]) -> str:
    """The dtype a Hugging Face config says its weights are stored in (``dtype``, or 4.x's
    ``torch_dtype``), as a name in ``_DTYPES``; float32 when it names none of them."""
    name = str(raw.get("dtype") or raw.get("torch_dtype"))
    return name if name in _DTYPES else "float32"


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers 5's ``rope_parameters`` with 4.x top-level ``rope_theta/rope_scaling``."""
    rope: dict[str, Any] = {}
    if "rope_theta" in raw:
        rope["rope_theta"] = raw["rope_theta"]
    if raw.get("rope_scaling"):
        rope.update(raw["rope_scaling"])
    if raw.get("rope_parameters"):
        rope.update(raw["rope_parameters"])
    if "type" in rope and "rope_type" not in rope:  # very old configs
        rope["rope_type"] = rope.pop("type")
    return rope


def _eos_ids(path: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (chat models list several there)."""
    ids: list[int] = []
    sources = [raw]
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (bf16 matmuls are slower there) and bfloat16 on GPU."""
    import torch

    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    dtype_of_name: torch.dtype = getattr(torch, dtype)  # the names are torch's
    return dtype_of_name
