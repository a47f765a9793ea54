"""``quantization=gguf``: a GGUF file's blocks kept and run by the quantized kernels. The
layers hold blocks, not floats; logits and greedy tokens match the dequantized model
(``none``); ``auto`` picks it for GGUF files on CPU; a block type without a kernel form falls
back to floats with one warning; the weights take a fraction of the float model's bytes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import arbor_kernels as kernels
import pytest
import torch
from arbor_kernels.quantized import QuantizedWeight

from runtime.gguf.blocks import decode_blocks
from runtime.layers.basic import Linear
from runtime.layers.quantized import QuantizedEmbedding, QuantizedLinear, resident_weight_bytes
from runtime.model_files import builtin_model_path, load_tokenizer
from runtime.model_loader import resolve_quantization
from runtime.model_runner import ModelRunner, RunnerConfig
from tests.runtime.gguf_files import write_gguf
from tests.runtime.paged_driver import PagedDriver
from tests.runtime.test_gguf_blocks import random_blocks

PROMPT = [5, 300, 1200, 7, 99, 2500, 40, 41, 42, 3000, 11, 600] * 3
# The quantized kernels may quantize activations per block (as llama.cpp does): logits agree
# with the dequantized model's to a share of their range, not to float32 rounding.
RELATIVE_TOLERANCE = 0.02
# A whole random-weight model quantizes every layer's activations to int8 per block (as
# llama.cpp does): measured 2.2-2.5% of the largest logit against the float model.
MODEL_TOLERANCE = 0.05
PASSAGE = (
    "The river rises in the hills north of the town and runs south through farmland for "
    "about forty miles before it reaches the sea. In spring the water is high and fast; by "
    "late summer children can wade across it at the old ford below the mill."
)


def _runner(path: str | Path, quantization: str, **kw: object) -> ModelRunner:
    config = RunnerConfig(
        str(path), dtype="float32", quantization=quantization, kv_slots=512, max_requests=4
    )
    return ModelRunner(config.__class__(**{**config.__dict__, **kw}))


def _logits(runner: ModelRunner) -> torch.Tensor:
    driver = PagedDriver(runner)
    return driver.extend([driver.new_sequence()], [PROMPT], logits="all")


def _assert_logits_agree(
    ours: torch.Tensor, expected: torch.Tensor, tolerance: float = RELATIVE_TOLERANCE
) -> None:
    worst = float((ours - expected).abs().max())
    assert worst <= tolerance * float(expected.abs().max()), worst


def _quantized_layers(runner: ModelRunner) -> list[str]:
    return [
        name
        for name, module in runner.model.named_modules()
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding))
    ]


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_runs_on_its_blocks_as_its_dequantized_model(
    tiny_model_path: Path, tmp_path: Path, tensor_type: str
) -> None:
    path = write_gguf(tiny_model_path, tmp_path / "model.gguf", tensor_type)
    quantized, dequantized = _runner(path, "gguf"), _runner(path, "none")
    layers = _quantized_layers(quantized)
    # Every projection, the embedding and the untied head hold blocks; the float model none.
    assert {"model.embed_tokens", "lm_head", "model.layers.0.self_attn.qkv_proj",
            "model.layers.0.mlp.down_proj"} <= set(layers)  # fmt: skip
    assert not _quantized_layers(dequantized)
    # Layer by layer the kernels equal their oracle tightly (tests/kernels/test_quantized.py);
    # through a whole model an int8 code that rounds the other way spreads, so the model is
    # held to the float model's logits within the activation quantization's error.
    _assert_logits_agree(_logits(quantized), _logits(dequantized), MODEL_TOLERANCE)


def test_each_architecture_runs_quantized(tiny_arch_model_path: Path, tmp_path: Path) -> None:
    """Llama's un-permuted q/k blocks, Qwen2's biases beside blocks, tied embeddings (Qwen)
    serving the lookup and the LM head."""
    path = write_gguf(tiny_arch_model_path, tmp_path / "model.gguf", "Q8_0")
    quantized, dequantized = _runner(path, "gguf"), _runner(path, "none")
    assert "model.embed_tokens" in _quantized_layers(quantized)
    # Layer by layer the kernels equal their oracle tightly (tests/kernels/test_quantized.py);
    # through a whole model an int8 code that rounds the other way spreads, so the model is
    # held to the float model's logits within the activation quantization's error.
    _assert_logits_agree(_logits(quantized), _logits(dequantized), MODEL_TOLERANCE)


def test_auto_keeps_the_blocks_of_a_gguf_file_on_cpu(tiny_model_path: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_path, tmp_path / "model.gguf", "Q8_0")
    runner = _runner(path, "auto")
    assert runner.quantization == "gguf" and _quantized_layers(runner)
    assert _runner(tiny_model_path, "auto").quantization == "none"  # a folder has no blocks
    assert resolve_quantization("auto", gguf_file=True, device="cuda") == "none"
    assert resolve_quantization("auto", gguf_file=True, tp_size=2) == "none"
    assert resolve_quantization("none", gguf_file=True) == "none"


def test_auto_dequantizes_where_the_quantized_kernels_are_not_native(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The torch reference dequantizes every weight on every call: auto must not pick it."""
    before = kernels.kernel_backend()
    kernels.set_kernel_backend("torch")
    try:
        with caplog.at_level(logging.WARNING, logger="runtime.model_loader"):
            assert resolve_quantization("auto", gguf_file=True) == "none"
    finally:
        kernels.set_kernel_backend(before)
    [record] = caplog.records
    assert "not built" in record.getMessage()


@pytest.mark.parametrize(("device", "tp_size"), [("cuda", 1), ("cpu", 2)])
def test_gguf_where_no_quantized_kernel_runs_is_dequantized_with_a_warning(
    device: str, tp_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.model_loader"):
        assert resolve_quantization("gguf", True, device, tp_size) == "none"
    [record] = caplog.records
    assert "dequantized" in record.getMessage()


def test_a_block_type_without_a_kernel_form_falls_back_to_floats_with_one_warning(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    path = write_gguf(tiny_model_path, tmp_path / "model.gguf", "Q5_1")
    monkeypatch.setattr("runtime.gguf.weights.BLOCK_TYPES", ("Q8_0",))  # as if Q5_1 had none
    with caplog.at_level(logging.WARNING, logger="runtime.gguf.weights"):
        runner = _runner(path, "gguf")
    [record] = [r for r in caplog.records if "dequantized" in r.getMessage()]
    assert "blk.0.attn_q.weight (Q5_1)" in record.getMessage()
    assert "token_embd.weight (Q5_1)" in record.getMessage()
    assert not _quantized_layers(runner)
    torch.testing.assert_close(_logits(runner), _logits(_runner(path, "none")), rtol=0, atol=0)


def test_stacked_pieces_of_different_formats_compute_as_their_floats() -> None:
    """q|k|v as Q4_K, Q6_K and F32 (files like Q4_K_M mix types within a layer); gate|up as
    one format, packed as one weight."""
    qkv = Linear(256, {"q": 4, "k": 2, "v": 2}, bias=True, dtype=torch.float32)
    qkv.weight.data.normal_()
    qkv.bias.data.normal_()  # type: ignore[union-attr]
    q = decode_blocks(random_blocks("Q4_K", 4, 256).reshape(-1), "Q4_K", (4, 256))
    k = decode_blocks(random_blocks("Q6_K", 2, 256, seed=1).reshape(-1), "Q6_K", (2, 256))
    layer = QuantizedLinear.of(qkv, {"q": q, "k": k})
    assert [type(p) for p in layer.pieces] == [QuantizedWeight, QuantizedWeight, torch.Tensor]
    x = torch.randn(3, 256)
    weight = torch.cat([q.dequantize(), k.dequantize(), qkv.weight[6:]])
    expected = torch.nn.functional.linear(x, weight, qkv.bias)
    _assert_logits_agree(layer(x), expected)

    gate_up = Linear(256, {"gate": 4, "up": 4}, bias=False, dtype=torch.float32)
    gate = decode_blocks(random_blocks("Q4_K", 4, 256, seed=2).reshape(-1), "Q4_K", (4, 256))
    up = decode_blocks(random_blocks("Q4_K", 4, 256, seed=3).reshape(-1), "Q4_K", (4, 256))
    merged = QuantizedLinear.of(gate_up, {"gate": gate, "up": up})
    assert len(merged.pieces) == 1
    weight = torch.cat([gate.dequantize(), up.dequantize()])
    _assert_logits_agree(merged(x), x @ weight.t())


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[ModelRunner, ModelRunner]]:
    """The built-in SmolLM2-135M-Instruct (Q4_1 matrices, Q8_0 tied embedding), quantized
    and dequantized."""
    path = builtin_model_path()
    yield _runner(path, "gguf"), _runner(path, "none", pack_weights=False)


def test_real_model_predicts_as_the_dequantized_model(
    smollm2: tuple[ModelRunner, ModelRunner],
) -> None:
    """Int8 activations move near-ties only: the next-token choice at (nearly) every position
    of a real passage is the float model's, and a plain fact comes out the same."""
    tokenizer = load_tokenizer(builtin_model_path())
    quantized, dequantized = smollm2
    assert quantized.quantization == "gguf"
    passage = tokenizer.encode(PASSAGE)
    drivers = [PagedDriver(quantized), PagedDriver(dequantized)]
    ours, theirs = (d.extend([d.new_sequence()], [passage], logits="all") for d in drivers)
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    assert agree >= 0.9, agree
    [answer] = drivers[0].greedy([tokenizer.encode("The capital of France is")], 2)
    assert "Paris" in tokenizer.decode(answer), tokenizer.decode(answer)


def test_real_model_weights_take_a_fraction_of_the_float_bytes(
    smollm2: tuple[ModelRunner, ModelRunner],
) -> None:
    quantized, dequantized = smollm2
    # Q4_1: 4-bit codes plus a scale and offset per 32; the float model 32 bits a weight.
    assert resident_weight_bytes(quantized.model) < 0.3 * resident_weight_bytes(dequantized.model)
