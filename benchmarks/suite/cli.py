"""``arbor bench``: run a workload on Arbor and on the baselines, side by side.

    arbor bench WORKLOAD [--model-path DIR|FILE.gguf] [--dtype D] [--quantization Q]
                         [--baseline transformers|llama.cpp|llama-server|all|none]
                         [--quick] [--plot out.png] [--out result.json]
    arbor bench serve --rate R [--model-path DIR|FILE.gguf]
                      [--requests-from random|few-shot|json] ...
    arbor bench quality [--model-path DIR|FILE.gguf] [--tasks ...] [--modes ...] ...

(equivalently ``python -m benchmarks.suite ...`` from the repository root). Workloads:
few-shot, multi-turn, tree-of-thought, agent, json, random. Arbor runs the workload first; each
baseline then replays exactly the calls Arbor made (same prompt tokens, same output token
counts). On a GGUF file every system runs the file: Arbor natively (its own ``--dtype`` and
``--quantization``, auto by default, as ``arbor serve`` would run it), llama.cpp and
llama-server on the file in its own quantization, transformers through its GGUF loader
(dequantized to float32); ``--gguf`` pairs a model folder with a GGUF file for llama.cpp.
Prints a table, writes JSON (default ``benchmarks/results/bench-WORKLOAD.json``) and,
with ``--plot``, a PNG chart. ``quality`` is ``benchmarks/quality_bench.py``: validity and
accuracy of structured output, per constrained mode (its own flags; default model: built-in).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from benchmarks.common import write_json
from benchmarks.suite import report
from benchmarks.suite.contention import measured
from benchmarks.suite.metrics import optimal_hit_rate, output_agreement, summarize
from benchmarks.suite.systems.llama_server_build import BIN_ENV
from benchmarks.suite.trace import SystemRun
from benchmarks.suite.workloads import WORKLOADS, Workload, create_workload
from benchmarks.suite.workloads.base import RequestListWorkload
from runtime.server_args import DTYPES

BASELINES = ("transformers", "llama.cpp", "llama-server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arbor bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model-path", help="HF model folder or GGUF file (default: the small test model)"
    )
    common.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="Arbor's --dtype (auto: as it serves)"
    )
    common.add_argument(
        "--quantization",
        default="auto",
        help="Arbor's --quantization (none: a GGUF file's blocks dequantized to --dtype; auto: "
        "Arbor's choice for the file)",
    )
    common.add_argument("--quick", action="store_true", help="small sizes (a minute or two)")
    common.add_argument("--requests", type=int, help="override the workload's request count")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--max-total-tokens", type=int, default=131072, help="Arbor's KV pool")
    common.add_argument("--plot", metavar="PNG", help="write a chart (needs matplotlib)")
    common.add_argument("--out", metavar="JSON", help="result file (default under results/)")
    commands = parser.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    for name, workload in WORKLOADS.items():
        offline = commands.add_parser(
            name, parents=[common], help=workload.summary, description=workload.__doc__
        )
        offline.add_argument(
            "--baseline",
            action="append",
            choices=[*BASELINES, "all", "none"],
            help="baselines to run (repeatable; default: all)",
        )
        offline.add_argument("--hf-batch", type=int, default=16, help="transformers batch size")
        offline.add_argument(
            "--compiled",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="DSL-program workloads: also run Arbor with compiled execution (the "
            "arbor-compiled row; the baselines replay the interpreted run's calls)",
        )
        offline.add_argument(
            "--gguf",
            help="llama.cpp, llama-server: run this GGUF (default: the model's own GGUF file, "
            "else the folder's float32 conversion)",
        )
        offline.add_argument(
            "--llama-server-bin",
            metavar="PATH",
            help=f"llama-server: run this binary (default: ${BIN_ENV}, else the cached build, "
            "else build it from llama-cpp-python's sdist: minutes)",
        )
    commands.add_parser(  # listed for -h; main hands its arguments to quality_bench
        "quality", help="structured-output quality per constrained mode (quality -h)"
    )
    serve = commands.add_parser(
        "serve", parents=[common], help="online: Poisson arrivals against arbor serve"
    )
    serve.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    serve.add_argument(
        "--requests-from",
        default="random",
        choices=[n for n, w in WORKLOADS.items() if issubclass(w, RequestListWorkload)],
        help="the workload whose requests are sent",
    )
    serve.add_argument("--max-seconds", type=float, help="deadline (default 300, quick 120)")
    serve.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT, s")
    serve.add_argument("--slo-itl", type=float, default=200.0, help="goodput SLO: mean ITL, ms")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["quality"]:  # not a replayed workload: its own flags and report
        from benchmarks.quality_bench import main as quality_main

        return quality_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.plot:
        report.require_matplotlib()
    model_path = args.model_path or _default_model()
    if args.workload == "serve":
        from benchmarks.suite.online import run_serve

        return run_serve(args, model_path, argv)
    return run_offline(args, model_path, argv)


def run_offline(args: argparse.Namespace, model_path: str, argv: list[str]) -> int:
    """Arbor, then each chosen baseline on Arbor's calls; the table, JSON and chart."""
    workload = create_workload(args.workload, args.quick, args.requests, args.seed)
    baselines = _chosen_baselines(args.baseline)
    load_before = os.getloadavg()
    ours = run_arbor(workload, model_path, arbor_settings(args))
    runs: list[SystemRun] = [ours]
    compiled = None
    if args.compiled:
        compiled = run_arbor_compiled(workload, model_path, arbor_settings(args))
    replays_from = 1 if compiled is None else 2
    if compiled is not None:
        runs.append(compiled)
    unavailable: dict[str, str] = {}
    checks: dict[str, Any] = {}
    note = _replay_note(ours)
    if "transformers" in baselines:
        from benchmarks.suite.systems.gguf_export import UnsupportedModel
        from benchmarks.suite.systems.transformers_baseline import TransformersBaseline

        try:
            baseline = TransformersBaseline(model_path, args.hf_batch)
        except UnsupportedModel as exc:
            unavailable["transformers"] = str(exc)
        else:
            runs.append(measured(lambda: baseline.replay(ours.calls, note)))
    if "llama.cpp" in baselines:
        from benchmarks.suite.systems import llama_cpp_baseline

        outcome = llama_cpp_baseline.replay(model_path, ours.calls, note, args.gguf)
        checks["llama.cpp"] = outcome.check
        if outcome.run is None:
            unavailable["llama.cpp"] = outcome.reason
        else:
            runs.append(outcome.run)
    if "llama-server" in baselines:
        from benchmarks.suite.systems import llama_server_baseline

        outcome = llama_server_baseline.replay(
            model_path, ours.calls, note, args.gguf, args.llama_server_bin
        )
        checks["llama-server"] = outcome.check
        if outcome.run is None:
            unavailable["llama-server"] = outcome.reason
        else:
            runs.append(outcome.run)
    load_after = os.getloadavg()
    summaries = [summarize(run) for run in runs]
    optimal = optimal_hit_rate(ours.calls)
    ratios = report.ratio_lines(summaries[:1] + summaries[replays_from:])
    agreement = {run.system: output_agreement(ours, run) for run in runs[replays_from:]}
    compiled_speedup = None
    if compiled is not None:
        compiled_speedup = summaries[1]["output_tokens_per_s"] / max(
            summaries[0]["output_tokens_per_s"], 1e-9
        )
    print(f"\n{workload.name}: {model_path}")
    print(
        f"load average before {report.format_load(load_before)}, after "
        f"{report.format_load(load_after)}\n"
    )
    report.print_systems(summaries, optimal)
    for system, reason in unavailable.items():
        print(f"  {system}: unavailable: {reason}")
    for system, ratio in ratios.items():
        same = agreement[system]
        agree = "" if same is None else f"; identical greedy outputs on {same:.0%} of calls"
        print(f"arbor / {system}: {ratio:.2f}x output tokens/s{agree}")
    if compiled_speedup is not None:
        print(f"arbor-compiled / arbor (interpreted): {compiled_speedup:.2f}x output tokens/s")
    payload = {
        "command": ["arbor", "bench", *argv],
        "model_path": model_path,
        "arbor_settings": arbor_settings(args),
        "workload": workload.describe(),
        "load_average": {"before": load_before, "after": load_after},
        "optimal_hit_rate": optimal,
        "systems": summaries,
        "ratios": ratios,
        "compiled_speedup": compiled_speedup,
        "output_agreement": agreement,
        "unavailable": unavailable,
        "checks": checks,
    }
    write_json(f"bench-{workload.name}", payload, args.out)
    if args.plot:
        report.plot(args.plot, f"{workload.name} on {os.path.basename(model_path)}", summaries)
    return 0


def arbor_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine settings Arbor's runs take from the command line."""
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "max_total_tokens": args.max_total_tokens,
    }


def run_arbor(workload: Workload, model_path: str, settings: dict[str, Any]) -> SystemRun:
    """Arbor's run on a fresh in-process Engine with ``settings`` (``arbor_settings``),
    stopped afterwards so the baselines get the whole machine."""
    from runtime import Engine

    with Engine(model_path, **settings) as engine:
        return measured(lambda: workload.run_arbor(engine))


def run_arbor_compiled(
    workload: Workload, model_path: str, settings: dict[str, Any]
) -> SystemRun | None:
    """The workload's DSL programs with compiled execution, on a fresh Engine configured as
    ``run_arbor``'s; None (no engine started) when the workload has no programs."""
    from runtime import Engine

    if type(workload).run_arbor_compiled is Workload.run_arbor_compiled:
        return None

    def run(engine: Engine) -> SystemRun:
        compiled = workload.run_arbor_compiled(engine)
        assert compiled is not None  # the workload overrides it (checked above)
        return compiled

    with Engine(model_path, **settings) as engine:
        return measured(lambda: run(engine))


def _replay_note(ours: SystemRun) -> str:
    constrained = sum(c.constrained for c in ours.calls)
    if not constrained:
        return ""
    return f"{constrained} constrained calls replayed unconstrained, same token counts"


def _chosen_baselines(chosen: list[str] | None) -> set[str]:
    names = set(chosen or ["all"])
    if "none" in names:
        return set()
    return set(BASELINES) if "all" in names else names


def _default_model() -> str:
    from runtime.test_model import cached_test_model

    return str(cached_test_model("small", "llama"))


if __name__ == "__main__":
    sys.exit(main())
