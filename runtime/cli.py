"""The ``arbor`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.server_args import ServerArgs
from runtime.test_model import ARCHITECTURES, CHAT_TEMPLATES, PRESETS

DRAFT_PRESET = "draft"  # make-test-model's preset for a draft cut from --target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arbor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser(
        "make-test-model",
        help="build a Hugging Face folder with a trained tokenizer and random weights",
    )
    make.add_argument("--out", help="folder to write (default: the shared cache, reused if built)")
    make.add_argument(
        "--preset",
        default="tiny",
        choices=[*sorted(PRESETS), DRAFT_PRESET],
        help="the model's shape (size); draft: the --target folder cut to its first layers, "
        "a draft model for speculative decoding (the shape and weight flags do not apply)",
    )
    make.add_argument("--target", help="the model folder a draft is cut from (--preset draft)")
    make.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="decoder layers the draft keeps (--preset draft; default 1)",
    )
    make.add_argument(
        "--arch", default="llama", choices=ARCHITECTURES, help="the Hugging Face architecture"
    )
    make.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="tokens in the vocabulary (default: the preset's)",
    )
    make.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    make.add_argument(
        "--chat-template",
        default="chatml",
        choices=sorted(CHAT_TEMPLATES),
        help="how the template writes turns and tool calls (chatml: hermes <tool_call> blocks)",
    )

    demo = commands.add_parser(
        "demo",
        help="serve the built-in model and show it answer, extract JSON and run a DSL program",
    )
    demo.add_argument(
        "--model-path", default=None, help="a GGUF file or model folder (default: built-in)"
    )
    demo.add_argument(
        "--prompt", default=None, help="the chat question (default: one with a known answer)"
    )
    demo.add_argument("--max-new-tokens", type=int, default=48, help="the longest chat answer")

    serve = commands.add_parser(
        "serve",
        help="run the HTTP server (native and OpenAI-compatible APIs)",
        description="Serve a model over HTTP: SGLang's native API and the OpenAI API "
        "(docs/serving.md). Without --model-path it serves the built-in model. Every flag is "
        "a field of runtime.ServerArgs.",
        usage="arbor serve [--model-path GGUF_FILE_OR_FOLDER] [options]",
    )
    ServerArgs.add_cli_args(serve)

    commands.add_parser(
        "bench",
        add_help=False,
        help="benchmark workloads against baselines (source checkout; `arbor bench -h`)",
    )

    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["bench"]:  # the benchmark suite parses its own flags
        return _bench(arguments[1:])
    args = parser.parse_args(argv)
    if args.command == "make-test-model":
        if args.preset != DRAFT_PRESET:
            if args.target is not None or args.num_layers is not None:
                make.error(f"--target and --num-layers go with --preset {DRAFT_PRESET} only")
            return _make_test_model(args)
        if args.target is None:
            make.error(f"--preset {DRAFT_PRESET} needs --target, the model folder to cut")
        try:
            return _make_draft_model(args)
        except ValueError as exc:  # a target that cannot be cut that way
            make.error(str(exc))
    if args.command == "demo":
        from runtime.server.demo import run_demo

        return run_demo(args.model_path, args.prompt, args.max_new_tokens)
    if args.command == "serve":
        try:
            server_args = ServerArgs.from_cli(args)
        except ValueError as exc:  # flags that parse but do not go together
            serve.error(str(exc))
        from runtime.errors import ModelLoadError
        from runtime.kv_budget import KVMemoryError, check_server_kv
        from runtime.server import launch_server

        try:
            check_server_kv(server_args)
            return launch_server(server_args)
        except ModelLoadError as exc:  # the model's files, named in one line
            print(f"arbor serve: error: {exc}", file=sys.stderr)
            return 1
        except KVMemoryError as exc:  # a pool size this machine cannot hold, in one line
            print(f"arbor serve: error: {exc}", file=sys.stderr)
            return 2
    return 2


def _bench(argv: list[str]) -> int:
    """Dispatch to ``benchmarks.suite`` (not an installed package): it is imported from the
    checkout this ``runtime`` package lives in, as ``python -m benchmarks.suite`` would be."""
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "benchmarks" / "suite" / "cli.py").is_file():
        print(
            f"arbor bench needs a source checkout: {checkout / 'benchmarks'} is missing "
            "(install arbor in editable mode from a clone: pip install -e .)",
            file=sys.stderr,
        )
        return 2
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from benchmarks.suite.cli import main as bench_main

    return bench_main(argv)


def _make_test_model(args: argparse.Namespace) -> int:
    from runtime.test_model import cached_test_model, make_test_model

    options = (args.preset, args.arch, args.vocab_size, args.seed, args.chat_template)
    if args.out:
        path = make_test_model(args.out, *options)
    else:
        path = cached_test_model(*options)
    print(path)
    return 0


def _make_draft_model(args: argparse.Namespace) -> int:
    from runtime.test_model import cached_draft_model, make_draft_model

    num_layers = 1 if args.num_layers is None else args.num_layers
    if args.out:
        path = make_draft_model(args.target, args.out, num_layers)
    else:
        path = cached_draft_model(args.target, num_layers)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
