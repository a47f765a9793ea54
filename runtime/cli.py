"""The ``arbor`` command line."""

from __future__ import annotations

import argparse
import sys

from runtime.server_args import ServerArgs
from runtime.test_model import ARCHITECTURES, PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arbor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser(
        "make-test-model",
        help="build a Hugging Face folder with a trained tokenizer and random weights",
    )
    make.add_argument("--out", help="folder to write (default: the shared cache, reused if built)")
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    make.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    make.add_argument("--vocab-size", type=int, default=None)
    make.add_argument("--seed", type=int, default=0)

    demo = commands.add_parser(
        "demo", help="serve the built-in test model and query it with the openai client"
    )
    demo.add_argument("--model-path", default=None, help="model folder (default: tiny test model)")
    demo.add_argument("--prompt", default="Write a haiku about trees.")
    demo.add_argument("--max-new-tokens", type=int, default=16)

    serve = commands.add_parser(
        "serve", help="run the HTTP server (native and OpenAI-compatible APIs)"
    )
    ServerArgs.add_cli_args(serve)

    args = parser.parse_args(argv)
    if args.command == "make-test-model":
        return _make_test_model(args)
    if args.command == "demo":
        from runtime.server.demo import run_demo

        return run_demo(args.model_path, args.prompt, args.max_new_tokens)
    if args.command == "serve":
        from runtime.server import launch_server

        return launch_server(ServerArgs.from_cli(args))
    return 2


def _make_test_model(args: argparse.Namespace) -> int:
    from runtime.test_model import cached_test_model, make_test_model

    if args.out:
        path = make_test_model(args.out, args.preset, args.arch, args.vocab_size, args.seed)
    else:
        path = cached_test_model(args.preset, args.arch, args.vocab_size, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
