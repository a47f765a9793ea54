"""Fixtures: the tiny model's tokenizer, an xgrammar backend and service over it, a model runner."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from grammar import GrammarBackend, GrammarService, create_backend
from runtime.model_config import ModelConfig
from runtime.model_runner import ModelRunner, RunnerConfig
from tests.grammar.decoder import ConstrainedDecoder


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def backend(tiny_model_path: Path, tokenizer: Any) -> GrammarBackend:
    config = ModelConfig.from_pretrained(tiny_model_path)
    return create_backend("xgrammar", tokenizer, config.vocab_size, config.eos_token_ids)


@pytest.fixture(scope="session")
def service(backend: GrammarBackend) -> Iterator[GrammarService]:
    svc = GrammarService(backend, cache_size=512, compile_timeout=60.0)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session")
def decoder(tiny_model_path: Path, tokenizer: Any, backend: GrammarBackend) -> ConstrainedDecoder:
    runner = ModelRunner(
        RunnerConfig(str(tiny_model_path), kv_slots=32768, max_requests=32, context_len=1024)
    )
    return ConstrainedDecoder(runner, tokenizer, backend)
