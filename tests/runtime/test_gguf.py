"""GGUF files load and compute as the Hugging Face folders they stand for: each architecture
(Llama's permuted q/k, Qwen2's biases, Qwen3's q/k norms and head_dim), each tensor type the
exporter writes, tied and untied heads; the config, tokenizer and template the converted
folder holds; the K-quant types through the weight reader."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.gguf import TENSOR_TYPES, iter_gguf_tensors
from runtime.gguf.metadata import TensorEntry
from runtime.model_config import ModelConfig
from runtime.model_files import load_tokenizer, locate_model
from runtime.model_runner import ModelRunner, RunnerConfig
from tests.runtime.gguf_files import reference_folder, write_gguf
from tests.runtime.paged_driver import PagedDriver

ATOL = 1e-4
PROMPT = [5, 300, 1200, 7, 99, 2500, 40, 41, 42, 3000, 11, 600] * 4


def _logits(model: str | Path) -> torch.Tensor:
    # Dequantized: this checks the file's decoding, which quantized execution would blur.
    config = RunnerConfig(
        str(model), dtype="float32", quantization="none", kv_slots=512, max_requests=4
    )
    runner = ModelRunner(config)
    driver = PagedDriver(runner)
    seq = driver.new_sequence()
    return driver.extend([seq], [PROMPT], logits="all")


def _hf_logits(folder: Path) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float()


def test_float32_gguf_of_each_architecture_computes_as_its_folder(
    tiny_arch_model_path: Path, tmp_path: Path
) -> None:
    path = write_gguf(tiny_arch_model_path, tmp_path / "model.gguf")
    torch.testing.assert_close(_logits(path), _hf_logits(tiny_arch_model_path), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_computes_as_its_dequantized_weights(
    tiny_model_path: Path, tmp_path: Path, tensor_type: str
) -> None:
    path = write_gguf(tiny_model_path, tmp_path / "model.gguf", tensor_type)
    oracle = reference_folder(tiny_model_path, tmp_path / "oracle", tensor_type)
    torch.testing.assert_close(_logits(path), _hf_logits(oracle), atol=ATOL, rtol=0)


def test_config_and_names_come_from_the_file(tiny_arch_model_path: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_arch_model_path, tmp_path / "model.gguf")
    ours, theirs = (
        ModelConfig.from_pretrained(path),
        ModelConfig.from_pretrained(tiny_arch_model_path),
    )
    for field in (
        "architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim", "intermediate_size", "rope_theta", "tie_word_embeddings", "bos_token_id",
    ):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.eos_token_ids[0] == theirs.eos_token_ids[0]
    assert ours.model_path == str(path.resolve())
    assert locate_model(path).served_name == tiny_arch_model_path.name


def test_tokenizer_and_template_equal_the_folders(
    tiny_arch_model_path: Path, tmp_path: Path
) -> None:
    path = write_gguf(tiny_arch_model_path, tmp_path / "model.gguf")
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(tiny_arch_model_path)
    for text in ("hello world", "  def f(x):\n\treturn x  ", "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == theirs(text).input_ids
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    render = {"tokenize": False, "add_generation_prompt": True}
    assert ours.apply_chat_template(messages, **render) == theirs.apply_chat_template(
        messages, **render
    )


def test_converted_folder_is_built_once_and_rebuilt_when_the_file_changes(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_model_path, tmp_path / "model.gguf")
    first = locate_model(path).config_dir
    stamp = (first / "arbor_gguf.json").stat().st_mtime_ns
    from runtime import model_files

    model_files._locate.cache_clear()  # as a new process finds it
    assert locate_model(path).config_dir == first  # found, not rebuilt
    assert (first / "arbor_gguf.json").stat().st_mtime_ns == stamp
    write_gguf(tiny_model_path, path, "Q8_0")  # a new file at the same path
    second = locate_model(path).config_dir
    assert second != first
    index = json.loads((second / "arbor_gguf.json").read_text())
    assert {t["tensor_type"] for t in index["tensors"]} >= {"Q8_0", "F32"}


# Bytes per block and where each K-quant block keeps its float16 scales.
_K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("tensor_type", sorted(_K_QUANT_SCALES))
def test_k_quant_tensors_read_as_gguf_dequantizes_them(tmp_path: Path, tensor_type: str) -> None:
    """gguf-py writes no K-quants, so the blocks here are random bytes with sane scales; what
    is checked is the reader's byte ranges and shapes for those types, gguf's dequantization
    being the arithmetic."""
    kind = gguf.GGMLQuantizationType[tensor_type]
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 3, 2 * block
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, 2, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[tensor_type]:
        raw[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = raw.reshape(rows, 2 * block_bytes)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors[0]
    entry = TensorEntry(
        "w", "w", tensor_type, (rows, cols), int(tensor.data_offset), int(tensor.n_bytes)
    )
    [(name, ours)] = list(iter_gguf_tensors(tmp_path / "k.gguf", [entry]))
    expected = gguf.quants.dequantize(raw, kind)
    assert ours.shape == (rows, cols) and ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), expected)
    assert tensor_type in TENSOR_TYPES


def test_gguf_target_and_draft_speculate_as_the_folders_do(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Both models of draft speculation as GGUF files: greedy text equals plain decoding."""
    import runtime
    from runtime.test_model import cached_draft_model

    target = write_gguf(tiny_model_path, tmp_path / "target.gguf")
    draft = write_gguf(cached_draft_model(tiny_model_path), tmp_path / "draft.gguf")
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompts = ["def parse(self, value):", "import os\nimport sys\n"]
    plain = runtime.Engine(tiny_model_path, max_total_tokens=2048)
    try:
        expected = [r["output_ids"] for r in plain.generate(prompts, params)]
    finally:
        plain.shutdown()
    speculative = runtime.Engine(
        target,
        max_total_tokens=2048,
        speculative_algorithm="draft",
        speculative_draft_model_path=str(draft),
    )
    try:
        assert [r["output_ids"] for r in speculative.generate(prompts, params)] == expected
    finally:
        speculative.shutdown()
