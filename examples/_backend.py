"""Command-line set-up shared by the examples: which backend to run on."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import frontend_lang as fl


def parse_args(description: str | None, max_tokens: int = 32) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model-path", help="a GGUF file or model folder (default: the built-in real model)"
    )
    parser.add_argument("--url", help="run on a live `arbor serve` at this URL instead")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser.parse_args()


@contextmanager
def open_backend(args: argparse.Namespace) -> Iterator[fl.Backend]:
    """A RuntimeEndpoint for ``--url``, else an in-process Engine on ``--model-path`` (or the
    built-in SmolLM2-135M-Instruct)."""
    if args.url:
        backend: fl.Backend = fl.RuntimeEndpoint(args.url)
    else:
        backend = fl.Engine(args.model_path, max_total_tokens=8192)
    try:
        yield backend
    finally:
        backend.shutdown()
