"""The GGUF conversion behind the llama.cpp baseline (skipped without the ``bench`` extra):
the RoPE layout permutation and Llama 3 factors by their math, the file's contents, and,
where llama-cpp-python is installed, llama.cpp's output against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from benchmarks.suite.systems.gguf_export import (  # noqa: E402
    _permute,
    export_gguf,
    llama3_rope_factors,
)


def test_permutation_turns_rotate_half_rope_into_interleaved_rope() -> None:
    heads, head_dim, hidden = 2, 8, 6
    rng = np.random.default_rng(0)
    weight, x = rng.normal(size=(heads * head_dim, hidden)), rng.normal(size=hidden)
    angles = 0.7 * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate_half(q: np.ndarray) -> np.ndarray:  # transformers' layout: halves
        a, b = q[: head_dim // 2], q[head_dim // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    def interleaved(q: np.ndarray) -> np.ndarray:  # llama.cpp's layout: adjacent pairs
        a, b = q[0::2], q[1::2]
        out = np.empty_like(q)
        out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    hf = (weight @ x).reshape(heads, head_dim)
    ours = (_permute(weight, heads) @ x).reshape(heads, head_dim)
    for h in range(heads):
        # same rotated vector up to the same reordering of its entries
        expected = rotate_half(hf[h])
        got = interleaved(ours[h])
        assert np.allclose(np.sort(expected), np.sort(got))
        assert np.allclose(got[0::2], expected[: head_dim // 2])
        assert np.allclose(got[1::2], expected[head_dim // 2 :])


def test_llama3_factors_match_transformers(tiny_model_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(tiny_model_path)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    rope = json.loads((tiny_model_path / "config.json").read_text())["rope_parameters"]
    head_dim = config.head_dim
    base = rope["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(base / llama3_rope_factors(rope, head_dim), scaled, rtol=1e-5)


def test_exported_file(tiny_model_path: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_model_path / "config.json").read_text())
    reader = gguf.GGUFReader(export_gguf(tiny_model_path, tmp_path / "tiny.gguf"))
    fields = {name: reader.fields[name] for name in reader.fields}

    def value(name: str) -> object:
        return fields[name].contents()

    assert value("general.architecture") == "llama"
    assert value("llama.block_count") == config["num_hidden_layers"]
    assert value("llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert value("llama.rope.freq_base") == pytest.approx(500000.0)
    assert value("tokenizer.ggml.pre") == "qwen2"
    assert value("tokenizer.ggml.bos_token_id") == config["bos_token_id"]
    assert len(value("tokenizer.ggml.tokens")) == config["vocab_size"]  # type: ignore[arg-type]
    names = {t.name for t in reader.tensors}
    assert {
        "token_embd.weight",
        "output.weight",
        "rope_freqs.weight",
        "blk.0.attn_q.weight",
    } <= names
    assert len(names) == 3 + 1 + 9 * config["num_hidden_layers"]


def test_llama_cpp_matches_transformers(tiny_model_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama

    from benchmarks.suite.systems.llama_cpp_baseline import check_against_transformers
    from benchmarks.suite.systems.model_source import converted

    llm = Llama(model_path=str(converted(str(tiny_model_path))), n_ctx=1024, verbose=False)
    check = check_against_transformers(llm, str(tiny_model_path))
    assert check["ok"], check
    assert check["max_abs_logit_diff"] < 0.05
