"""One real server for the fuzz suite (started on first use, stopped after the last test), and
Hypothesis as the rest of the suite knows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hypothesis.core
import pytest
import schemathesis.generation.hypothesis.builder  # noqa: F401  (applies the patches below)
from hypothesis.internal.conjecture import engine
from hypothesis.strategies._internal import collections
from hypothesis.vendor import pretty

from tests.fuzz.fuzz_server import FuzzServer

# Hypothesis' own buffer size (hypothesis.internal.conjecture.engine.BUFFER_SIZE).
HYPOTHESIS_BUFFER_SIZE = 8 * 1024


def _undo_schemathesis_patches() -> None:
    """Importing schemathesis (its pytest plugin loads on every run) patches Hypothesis for the
    whole process: a printer that prints nothing, so every falsifying example in every test
    reads ``x=,``, and a buffer four times Hypothesis' own, so derandomized tests draw other
    examples. Put Hypothesis back; schemathesis does not patch twice."""
    hypothesis.core.RepresentationPrinter = pretty.RepresentationPrinter  # type: ignore[misc]
    for module in (hypothesis.core, engine, collections):
        module.BUFFER_SIZE = HYPOTHESIS_BUFFER_SIZE  # type: ignore[attr-defined]


_undo_schemathesis_patches()


@pytest.fixture(scope="package")
def fuzz_server(tiny_model_path: Path) -> Iterator[FuzzServer]:
    server = FuzzServer(tiny_model_path)
    try:
        server.ensure_up()
        yield server
    finally:
        server.stop()
