"""Write a Hugging Face model folder with a trained tokenizer and seeded random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from runtime.cache_dir import building, cache_root, exclusive
from runtime.test_model.chat_templates import BOS, EOS, PAD, get_chat_template
from runtime.test_model.presets import ARCHITECTURES, Preset, get_preset
from runtime.test_model.tokenizer import train_tokenizer

# Bump when the folder contents change, so cached folders are rebuilt.
BUILDER_VERSION = 1


def default_cache_dir() -> Path:
    return cache_root() / "models"


def make_test_model(
    out: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    vocab_size: int | None = None,
    seed: int = 0,
    chat_template: str = "chatml",
) -> Path:
    """Build the folder at ``out`` (replacing it) and return its path. ``chat_template``:
    chatml, plain, llama3, mistral or qwen3 (``chat_templates.CHAT_TEMPLATES``), with its
    tokens."""
    template = get_chat_template(chat_template)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    shape = get_preset(preset).for_arch(arch)
    vocab = vocab_size or shape.vocab_size
    out = Path(out)
    with building(out) as tmp:
        tokenizer = train_tokenizer(
            vocab, seed, add_bos=(arch == "llama"), chat_template=chat_template
        )
        tokenizer.save_pretrained(tmp)
        vocab_map = tokenizer.get_vocab()
        ids = {name: vocab_map[name] for name in (BOS, EOS, PAD, template.turn_end)}
        config = _hf_config(shape, arch, vocab, ids)
        config.save_pretrained(tmp)
        generation = {
            "bos_token_id": ids[BOS],
            "eos_token_id": list(dict.fromkeys([ids[EOS], ids[template.turn_end]])),
            "pad_token_id": ids[PAD],
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        weights = random_weights(config, arch, seed, getattr(torch, shape.dtype))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "arbor_test_model.json").write_text(
            json.dumps(
                {
                    "preset": preset,
                    "arch": arch,
                    "vocab_size": vocab,
                    "seed": seed,
                    "chat_template": chat_template,
                    "builder_version": BUILDER_VERSION,
                },
                indent=2,
            )
            + "\n"
        )
    return out


def cached_test_model(
    preset: str = "tiny",
    arch: str = "llama",
    vocab_size: int | None = None,
    seed: int = 0,
    chat_template: str = "chatml",
) -> Path:
    """The folder for these arguments under the cache dir, built once (safe across processes)."""
    get_chat_template(chat_template)
    vocab = vocab_size or get_preset(preset).vocab_size
    root = default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    name = f"{preset}-{arch}-v{vocab}-s{seed}-b{BUILDER_VERSION}"
    if chat_template != "chatml":  # chatml folders keep the names they had before templates
        name += f"-{chat_template}"
    out = root / name
    with exclusive(out):
        if not (out / "arbor_test_model.json").exists():
            make_test_model(out, preset, arch, vocab_size, seed, chat_template)
    return out


def _hf_config(shape: Preset, arch: str, vocab: int, ids: dict[str, int]) -> PretrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        head_dim=shape.head_dim or shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype=shape.dtype,
    )
    if arch == "llama":
        # Llama 3.1-style frequency scaling, with a short original context so it bites.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
        return LlamaConfig(
            **common,
            rope_parameters=rope,
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "qwen2":
        return Qwen2Config(
            **common,
            rope_parameters=rope,
            tie_word_embeddings=True,
            architectures=["Qwen2ForCausalLM"],
        )
    return Qwen3Config(
        **common, rope_parameters=rope, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]
    )


def random_weights(
    config: PretrainedConfig, arch: str, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Seeded weights under Hugging Face names, scaled so random logits are well spread.

    Projections are drawn with std 1/sqrt(fan_in) (activations keep unit scale through the
    layers), embeddings with std 2/sqrt(hidden) (logit std about 2), norm weights near 1: the
    result is varied noise text with clear argmax margins.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = config.head_dim
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if arch == "qwen2":
            shapes |= {
                p + f"self_attn.{n}_proj.bias": (o,)
                for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))
            }
        if arch == "qwen3":
            shapes |= {
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
            }
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            w = 0.1 * torch.randn(shape, generator=gen)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            # Small next to the layers' outputs, or a tied head keeps predicting its input.
            w = 2.0 * torch.randn(shape, generator=gen) / hidden**0.5
        else:
            w = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        weights[name] = w.to(dtype).contiguous()
    return weights
