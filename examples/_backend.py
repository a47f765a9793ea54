"""Command-line set-up shared by the examples: which backend to run on."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import frontend_lang as fl


def parse_args(description: str | None, max_tokens: int = 32) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-path", help="model folder (default: the tiny test model)")
    parser.add_argument("--url", help="run on a live `arbor serve` at this URL instead")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser.parse_args()


@contextmanager
def open_backend(args: argparse.Namespace) -> Iterator[fl.Backend]:
    """A RuntimeEndpoint for ``--url``, else an in-process Engine on ``--model-path`` (or the
    tiny random-weight test model, whose text is noise but whose mechanics are real)."""
    if args.url:
        backend: fl.Backend = fl.RuntimeEndpoint(args.url)
    else:
        path = args.model_path
        if path is None:
            from runtime.test_model import cached_test_model

            path = cached_test_model("tiny", "llama")
        backend = fl.Engine(path, max_total_tokens=8192)
    try:
        yield backend
    finally:
        backend.shutdown()
