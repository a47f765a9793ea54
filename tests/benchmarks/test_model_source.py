"""A benchmark's model path may be a GGUF file: each system gets the model from it (Arbor and
tokenizers through runtime.model_files, transformers dequantized with ``gguf_file=``,
llama.cpp the file itself), and ``arbor bench`` runs on it end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from benchmarks.suite.systems.gguf_export import UnsupportedModel, export_gguf  # noqa: E402
from benchmarks.suite.systems.model_source import (  # noqa: E402
    context_length,
    gguf_file,
    llama_cpp_file,
    load_hf_model,
)
from runtime.cli import main  # noqa: E402
from runtime.test_model import cached_test_model  # noqa: E402

PROMPT = [5, 300, 1200, 7, 99, 2500, 40, 41, 42, 3000, 11, 600]


@pytest.fixture
def qwen2_folder() -> Path:
    """A tiny model with plain RoPE (the tiny llama's Llama 3 scaling is refused below)."""
    return cached_test_model("tiny", "qwen2")


@pytest.fixture
def tiny_gguf(qwen2_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``qwen2_folder`` as a float32 GGUF file (its converted folder in a private cache)."""
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path / "cache"))
    return export_gguf(qwen2_folder, tmp_path / "tiny.gguf")


def test_llama_cpp_runs_a_gguf_file_itself_and_a_folder_through_its_conversion(
    qwen2_folder: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    assert gguf_file(str(tiny_gguf)) == tiny_gguf.resolve()
    assert llama_cpp_file(str(tiny_gguf)) == tiny_gguf.resolve()
    assert gguf_file(str(qwen2_folder)) is None
    converted = llama_cpp_file(str(qwen2_folder))
    assert converted.suffix == ".gguf" and converted.parent == tmp_path / "cache" / "gguf"
    assert context_length(str(tiny_gguf)) == context_length(str(qwen2_folder))


def test_transformers_loads_a_gguf_file_as_the_folder_it_came_from(
    qwen2_folder: Path, tiny_gguf: Path
) -> None:
    with torch.no_grad():
        ours = load_hf_model(str(tiny_gguf))(torch.tensor([PROMPT])).logits
        folder = load_hf_model(str(qwen2_folder))(torch.tensor([PROMPT])).logits
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, folder, atol=1e-4, rtol=1e-4)


def test_transformers_refuses_a_gguf_file_it_would_misread(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' GGUF loader drops the rope_freqs tensor: Llama 3 RoPE scaling is lost
    monkeypatch.setenv("ARBOR_CACHE_DIR", str(tmp_path / "cache"))
    llama3 = export_gguf(tiny_model_path, tmp_path / "llama3.gguf")
    with pytest.raises(UnsupportedModel, match="rope_type 'default', not 'divisors'"):
        load_hf_model(str(llama3))


def test_bench_takes_a_gguf_model_path(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", "random", "--quick", "--requests", "2", "--model-path", str(tiny_gguf),
            "--baseline", "transformers", "--hf-batch", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [s["system"] for s in result["systems"]] == ["arbor", "transformers"]
    # the same weights on both sides: greedy outputs agree call for call
    assert result["output_agreement"]["transformers"] == 1.0
