"""Arbor and llama.cpp predict the same next tokens on the same GGUF file over real English,
dequantized and with quantized execution, which keeps the float model's perplexity (skipped,
with the install command, where llama-cpp-python or the built-in model is missing); the
agreement and perplexity arithmetic on hand-made logits."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from benchmarks.common import ENGLISH_PASSAGE
from benchmarks.llama_cpp_agreement import compare, measure, perplexity
from runtime.errors import ModelLoadError
from runtime.model_files import BUILTIN_INSTALL, builtin_model_path, load_tokenizer


def _builtin_model() -> str:
    try:
        return builtin_model_path()
    except ModelLoadError:
        pytest.skip(f"the built-in model is not installed: {BUILTIN_INSTALL}")


def test_compare_counts_same_top1_and_each_systems_hits_on_the_text() -> None:
    ids = [3, 1, 2, 0]
    ours = np.eye(5, dtype=np.float32)[[1, 2, 0, 4]]  # predicts 1, 2, 0, 4
    theirs = ours.copy()
    theirs[2] = [0.0, 0.0, 0.0, 0.9, 0.0]  # top-1 3 where ours says 0
    ours[2, 3] = 0.75  # ours saw 3 too, 0.25 below its choice
    theirs = np.concatenate([theirs, np.full((4, 1), -9.0, np.float32)], axis=1)  # padded vocab
    result = compare(ours, theirs, ids)
    assert (result.positions, result.agreed, result.rate) == (4, 3, 0.75)
    assert result.disagreements == [(2, 0, 3, pytest.approx(0.25))]
    assert result.arbor_text_top1 == 1.0  # 1, 2, 0 follow 3, 1, 2
    assert result.llama_cpp_text_top1 == pytest.approx(2 / 3)
    assert result.max_abs_logit_diff == pytest.approx(1.0)


def test_compare_refuses_logits_for_other_tokens() -> None:
    with pytest.raises(ValueError, match="for 3 tokens"):
        compare(np.zeros((4, 5)), np.zeros((4, 5)), [1, 2, 3])


def test_the_passage_gives_over_300_positions() -> None:
    ids = load_tokenizer(_builtin_model())(ENGLISH_PASSAGE.read_text()).input_ids
    assert len(ids) >= 400


def test_perplexity_is_the_exp_of_the_texts_mean_negative_log_likelihood() -> None:
    probs = np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]])
    ids = [0, 1, 1]  # row 0 gives the 1 after it 0.25, row 1 the next 1 0.8; row 2 is unused
    expected = math.exp(-(math.log(0.25) + math.log(0.8)) / 2)
    assert perplexity(np.log(probs) + 3.0, ids) == pytest.approx(expected)  # any logit shift


needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: pip install -c constraints.txt -e '.[llama-cpp]' "
    "(builds llama.cpp from source, ~9 min)",
)


@needs_llama_cpp
def test_arbor_agrees_with_llama_cpp_on_the_builtin_model() -> None:
    result = measure(_builtin_model(), quantization="none")
    assert result.tokenizer_equal
    assert result.positions >= 300
    assert result.rate >= 0.95, result.disagreements
    # both run a language model, not agree on noise: far above chance (1 in 49,152)
    assert result.arbor_text_top1 > 0.25 and result.llama_cpp_text_top1 > 0.25


@needs_llama_cpp
def test_quantized_execution_agrees_and_keeps_the_float_models_perplexity() -> None:
    """``quantization=gguf`` (the blocks run as they are): the issue's targets are 98%
    agreement and perplexity within 1% of the dequantized float32 model's (docs/benchmarks.md
    has the figures); the agreement floor here is the dequantized model's."""
    result = measure(_builtin_model(), quantization="gguf")
    assert result.positions >= 500
    assert result.rate >= 0.95, result.disagreements
    assert result.float_perplexity is not None and result.perplexity_ratio is not None
    assert abs(result.perplexity_ratio - 1) <= 0.01, (result.perplexity, result.float_perplexity)
