"""Write a Hugging Face folder (Llama, Mistral, Qwen2, Qwen3) as a GGUF file for llama.cpp,
in float32 or with its matrices in one of ggml's block formats.

What is carried over: the hyper-parameters, RoPE (theta; linear scaling; Llama 3 scaling as a
``rope_freqs`` tensor of per-dimension divisors, as llama.cpp's own converter writes it), the
byte-level BPE tokenizer (tokens and their types, merges, BOS/EOS/PAD ids, whether BOS is
added, the pre-tokenizer's regex by name) and the chat template. Llama's Q and K projections
are permuted from Hugging Face's rotate-half layout to llama.cpp's interleaved RoPE layout
(Qwen's are not: llama.cpp runs them with rotate-half RoPE). Qwen2's q/k/v biases and Qwen3's
q/k norms are written as llama.cpp names them.
Needs the ``gguf`` package (the ``bench`` extra).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

# Split regexes of byte-level BPE pre-tokenizers, by llama.cpp's pre-tokenizer name.
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# model_type -> llama.cpp's architecture name.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Block formats gguf-py can write; a matrix whose rows do not split into whole blocks stays F32.
QUANTIZED_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


class UnsupportedModel(ValueError):
    """The folder uses something this converter does not write (the message says what)."""


def export_gguf(model_dir: str | Path, out: str | Path, tensor_type: str = "F32") -> Path:
    """Convert ``model_dir`` (Llama, Mistral, Qwen2 or Qwen3; safetensors) to ``out``, its
    matrices in ``tensor_type`` (F32 or one of ``QUANTIZED_TYPES``; norms, biases and RoPE
    factors stay F32, as llama.cpp keeps them). Raises UnsupportedModel for other
    architectures, RoPE types or tokenizers."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHITECTURES.get(config.get("model_type", ""))
    if arch is None:
        raise UnsupportedModel(
            f"model_type {config.get('model_type')!r}: converted are {', '.join(ARCHITECTURES)}"
        )
    if tensor_type != "F32" and tensor_type not in QUANTIZED_TYPES:
        raise UnsupportedModel(f"tensor type {tensor_type!r}: F32, {', '.join(QUANTIZED_TYPES)}")
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    _add_hyper_parameters(writer, config)
    file_type = "ALL_F32" if tensor_type == "F32" else f"MOSTLY_{tensor_type}"
    writer.add_file_type(gguf.LlamaFileType[file_type])
    _add_tokenizer(writer, model_dir, config["vocab_size"])
    for name, tensor in _tensors(model_dir, config, permute_qk=arch == "llama"):
        _add_tensor(writer, name, tensor, tensor_type)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: Any, name: str, array: np.ndarray, tensor_type: str) -> None:
    """Write a matrix in ``tensor_type`` when its rows split into whole blocks, else F32."""
    import gguf

    kind = gguf.GGMLQuantizationType[tensor_type]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if tensor_type == "F32" or array.ndim != 2 or array.shape[1] % block:
        writer.add_tensor(name, array)
        return
    if tensor_type == "F16":
        writer.add_tensor(name, array.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def _add_hyper_parameters(writer: Any, config: dict[str, Any]) -> None:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    rope = _rope_parameters(config)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind not in ("default", "llama3"):
        raise UnsupportedModel(f"rope_type {kind!r} is not converted (default, linear, llama3)")


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5), else ``rope_theta`` + ``rope_scaling``."""
    if "rope_parameters" in config:
        return dict(config["rope_parameters"])
    return {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors that turn RoPE's inverse frequencies into Llama 3's scaled ones:
    1 for high frequencies, ``factor`` for low ones, a smooth blend in between."""
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < old_context / high:
            divisors.append(1.0)
        elif wavelength > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from rotate-half order (x0..x_{d/2-1}, y0..) to interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensors(
    model_dir: Path, config: dict[str, Any], permute_qk: bool
) -> list[tuple[str, np.ndarray]]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    if not weights:
        raise UnsupportedModel(f"no *.safetensors in {model_dir}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    named = []
    for hf_name, tensor in weights.items():
        array = tensor.float().numpy()
        if hf_name in GLOBAL_TENSORS:
            named.append((GLOBAL_TENSORS[hf_name], array))
            continue
        parts = hf_name.split(".", 3)  # model, layers, i, rest
        if parts[:2] != ["model", "layers"] or parts[3] not in LAYER_TENSORS:
            raise UnsupportedModel(f"tensor {hf_name!r} has no llama.cpp counterpart here")
        if permute_qk and parts[3] == "self_attn.q_proj.weight":
            array = _permute(array, heads)
        elif permute_qk and parts[3] == "self_attn.k_proj.weight":
            array = _permute(array, kv_heads)
        named.append((f"blk.{parts[2]}.{LAYER_TENSORS[parts[3]]}", array))
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type")) == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        named.append(("rope_freqs.weight", llama3_rope_factors(rope, head_dim)))
    return named


def _add_tokenizer(writer: Any, model_dir: Path, vocab_size: int) -> None:
    import gguf
    from transformers import AutoTokenizer

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    if spec["model"]["type"] != "BPE":
        raise UnsupportedModel(f"tokenizer model {spec['model']['type']!r}: only BPE")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            plain = gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL
            types.append(gguf.TokenType.CONTROL if special else plain)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token_id, add in (
        (tokenizer.bos_token_id, writer.add_bos_token_id),
        (tokenizer.eos_token_id, writer.add_eos_token_id),
        (tokenizer.pad_token_id, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    adds_bos = tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
    writer.add_add_bos_token(adds_bos)
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)


def _pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for the pre-tokenizer: a known Split regex (followed by a regex-free
    ByteLevel), or GPT-2's ByteLevel with its built-in regex."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    if steps and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"
    if steps and steps[0].get("type") == "Split":
        pattern = steps[0]["pattern"].get("Regex", "")
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    raise UnsupportedModel(f"pre-tokenizer not recognised: {json.dumps(pre)[:200]}")
