"""Where one batch-1 decode step of a real model goes: linears, each other op kind, overhead.

Loads the built-in SmolLM2-135M (or ``--model-path``) dequantized to float32, prefills
``--context`` tokens of English text, then times decode steps of one request through the bare
``ModelRunner`` with a timer around every kernel op, every projection and the KV write. What
no timer covers (Python, module calls, kernel dispatch, views and splits) is reported as
``python+dispatch``. The timers cost about a microsecond a call, so the timed step is also
reported beside an untimed one. ``--engine`` adds one decode step through ``runtime.Engine``
(scheduler, sampling, detokenizing), measured as the time per token of a long greedy
generation less a one-token one, to show the scheduler's share.

    python -m benchmarks.decode_breakdown [--context 128] [--steps 50] [--engine] [--threads N]
        [--clock wall|cpu] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import arbor_kernels as kernels
import arbor_kernels.ops
import torch

import runtime.layers.basic
import runtime.layers.rotary
import runtime.models.llama
from benchmarks.common import ENGLISH_PASSAGE, print_table, write_json
from runtime.layers.parallel import VocabParallelEmbedding
from runtime.model_files import builtin_model_path, load_tokenizer
from runtime.model_runner import ModelRunner, RunnerConfig

Clocks = dict[str, list[float]]  # op kind -> [seconds, calls]
# The clock every time here is read from: wall time, or with ``--clock cpu`` this thread's CPU
# time (on one torch thread all of a step's work is on this thread), which a busy machine's
# preemptions do not inflate.
_clock = {"now": time.perf_counter}


def _now() -> float:
    return _clock["now"]()


def _timed(fn: Callable[..., Any], clocks: Clocks, kind: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = _now()
        try:
            return fn(*args, **kwargs)
        finally:
            clock = clocks[kind]
            clock[0] += _now() - start
            clock[1] += 1

    return timed


@contextmanager
def _op_timers(runner: ModelRunner, clocks: Clocks) -> Iterator[None]:
    """Time every kernel op (by its name), the projections (``linear``), the KV write, the
    embedding lookup and the per-step cos/sin while inside."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, _timed(original, clocks, kind))

    for name, fn in vars(kernels.ops).items():
        if callable(fn) and hasattr(fn, "__wrapped__") and hasattr(kernels, name):
            patch(kernels, name, name)
    for module in (runtime.layers.basic, runtime.models.llama):
        patch(module, "packed_linear", "linear")
    patch(runner.kv_pool, "write", "kv_write")
    patch(VocabParallelEmbedding, "forward", "embedding")
    patch(runtime.layers.rotary.RotaryEmbedding, "forward", "rotary_cos_sin")
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            if owner is runner.kv_pool:
                delattr(owner, name)  # back to the class's method
            else:
                setattr(owner, name, original)


def _decode_step(runner: ModelRunner, row: int, context: int) -> Callable[[], None]:
    def step() -> None:
        runner.forward(runner.build_batch([row], [context], [[42]]))

    return step


def breakdown(runner: ModelRunner, model_path: str, context: int, steps: int) -> dict[str, Any]:
    """Median ms per decode step, untimed and timed, and each op kind's ms and calls a step."""
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer.encode(ENGLISH_PASSAGE.read_text())[:context]
    assert len(ids) == context, f"the passage holds fewer than {context} tokens"
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(1, context + 2))  # slot 0 is padding
    runner.forward(runner.build_batch([row], [0], [ids]))
    step = _decode_step(runner, row, context)
    for _ in range(5):
        step()
    plain, timed = [], []
    per_step: list[Clocks] = []
    for _ in range(steps):  # interleaved, so both see the same machine load
        start = _now()
        step()
        plain.append(_now() - start)
        clocks: Clocks = defaultdict(lambda: [0.0, 0])
        with _op_timers(runner, clocks):
            start = _now()
            step()
            timed.append(_now() - start)
        per_step.append(clocks)
    runner.req_to_token_pool.free(row)
    best = min(range(steps), key=lambda i: timed[i])
    clocks = per_step[best]
    total = timed[best]
    ops = {kind: {"ms": round(s * 1e3, 3), "calls": n} for kind, (s, n) in clocks.items()}
    covered = sum(sec for sec, _ in clocks.values())
    ops["python+dispatch"] = {"ms": round((total - covered) * 1e3, 3), "calls": 0}
    return {
        "context": context,
        "step_ms_untimed_best": round(min(plain) * 1e3, 3),
        "step_ms_untimed_median": round(statistics.median(plain) * 1e3, 3),
        "step_ms_timed": round(total * 1e3, 3),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"])),
    }


def engine_step(model_path: str, tokens: int, quantization: str = "none") -> dict[str, float]:
    """ms per generated token through ``Engine`` (greedy, EOS ignored): (time of ``tokens`` new
    tokens - time of 1) / (tokens - 1), best of three, each after a cache flush so that both
    prefill the same prompt. With ``--clock cpu`` the time is the process's CPU time (every
    thread: scheduler, forward, detokenizer, tokenizer manager)."""
    now = time.process_time if _clock["now"] is time.thread_time else time.perf_counter
    from runtime.engine import Engine

    prompt = ENGLISH_PASSAGE.read_text()[:600]
    params: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
    with Engine(model_path, quantization=quantization, max_total_tokens=4096) as engine:

        def run(n: int) -> float:
            engine.flush_cache()
            start = now()
            engine.generate(prompt, {**params, "max_new_tokens": n})
            return now() - start

        run(4)
        one, many = [], []
        for _ in range(3):
            one.append(run(1))
            many.append(run(tokens))
    return {"ms_per_token": round((min(many) - min(one)) / (tokens - 1) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--engine", action="store_true", help="also time a step via Engine")
    parser.add_argument("--engine-tokens", type=int, default=65)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu: this thread's CPU time, robust to a busy machine (implies --threads 1)",
    )  # fmt: skip
    parser.add_argument(
        "--quantization", choices=("none", "gguf"), default="none",
        help="gguf: a GGUF file's blocks in the quantized kernels (none: dequantized float32)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args()
    if args.clock == "cpu":
        args.threads = 1
        _clock["now"] = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model_path or builtin_model_path()
    runner = ModelRunner(RunnerConfig(
        model_path, kv_slots=args.context + 64, max_requests=2, context_len=args.context + 8,
        quantization=args.quantization,
    ))  # fmt: skip
    result = breakdown(runner, model_path, args.context, args.steps)
    rows = [[kind, v["ms"], v["calls"], f"{v['ms'] / result['step_ms_timed']:.1%}"]
            for kind, v in result["ops"].items()]  # fmt: skip
    print_table(["op kind", "ms/step", "calls/step", "share"], rows)
    print(
        f"\ndecode step, batch 1, context {args.context}: untimed best "
        f"{result['step_ms_untimed_best']} ms (median {result['step_ms_untimed_median']}), "
        f"timed {result['step_ms_timed']} ms"
    )
    payload: dict[str, Any] = {
        "model": Path(model_path).name, "threads": torch.get_num_threads(), "clock": args.clock,
        "native_kernels": kernels.native_available(), "breakdown": result,
    }  # fmt: skip
    if args.engine:
        payload["engine"] = engine_step(model_path, args.engine_tokens, args.quantization)
        print(
            f"Engine: {payload['engine']['ms_per_token']} ms/token; bare forward "
            f"{result['step_ms_untimed_best']} ms"
        )
    write_json("decode_breakdown", payload, args.out)


if __name__ == "__main__":
    main()
