"""Arbor vs llama.cpp (and transformers) on the same weights: load, memory, prefill, decode.

On a preset (the default; random weights): Arbor's model runner alone (one packed forward per
step, native kernels, oneDNN projections): prefill of one ``--prompt-len`` prompt, and decode
steps of B sequences at context ``--prompt-len``. llama.cpp on the same float32 GGUF:
llama-cpp-python for prefill and batch-1 decode (one sequence, token by token), llama-server
(``-np B``, continuous batching) for B > 1, where the decode rate is the sum of the B slots' own
rates as the server reports them (``timings.predicted_per_second``) while all B decode
together. Sampling is greedy.

On a real model (``--model-path FILE.gguf``, or a folder): Arbor (a ``runtime.Engine``:
scheduler, sampling and streaming included, as llama.cpp's own loop is; ``--dtype`` and
``--quantization`` pass through, Arbor's defaults otherwise: ``none`` dequantizes the file's
blocks, ``gguf`` keeps them), transformers (``gguf_file=``, dequantized to float32) and
llama.cpp (the file as it is), each loaded in a process of its own
(benchmarks/cpu_anchor_worker.py), all on the same thread count: load time, resident memory,
single-stream prefill of ``--prompt-len`` tokens and decode after it, and decode of B
sequences of ``--batch-context`` tokens for each B of ``--batches`` (llama.cpp: on
llama-server, as above).
Prompts are English text (benchmarks/data/). ``--rounds N`` runs every system N times,
interleaved, and keeps each number's best (a shared machine's bursts hit one round).

    python -m benchmarks.cpu_anchor_bench [--preset qwen2.5-0.5b-shape] [--batches 1,8,32]
        [--prompt-len 128] [--steps 32]
    python -m benchmarks.cpu_anchor_bench --model-path FILE.gguf [--batches 1,8,32]
        [--prompt-len 512] [--batch-context 128] [--steps 32] [--rounds 3]
        [--quantization auto|none|gguf] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import arbor_kernels as kernels
import httpx
import torch

from benchmarks.common import ENGLISH_PASSAGE, best_time, print_table, write_json
from benchmarks.suite.systems.llama_cpp_load import (
    NO_EXTRA_BUFFERS_NOTE,
    extra_buffers_crash,
    open_llama,
    server_flags,
)
from benchmarks.suite.systems.llama_server_baseline import free_port
from benchmarks.suite.systems.llama_server_build import BuildError, find_or_build
from benchmarks.suite.systems.llama_server_process import LlamaServer, ServerConfig, ServerError
from benchmarks.suite.systems.model_source import converted, llama_cpp_file
from runtime.model_files import load_tokenizer, locate_model
from runtime.model_runner import ModelRunner, RunnerConfig
from runtime.test_model import cached_test_model

SYSTEMS = ("arbor", "transformers", "llama.cpp")
# Lower is better for these; every other number is a rate.
LOWER_IS_BETTER = ("load_s", "rss_load_mb", "rss_peak_mb", "rss_run_mb")


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 8000), (batch, length), generator=gen).tolist()


def arbor(model: str, batches: list[int], prompt_len: int, steps: int) -> dict[str, float]:
    runner = ModelRunner(RunnerConfig(
        model, kv_slots=max(batches) * (prompt_len + steps + 8) + 1024,
        max_requests=max(batches), context_len=prompt_len + steps + 8,
    ))  # fmt: skip
    vocab = runner.config.vocab_size
    result: dict[str, float] = {}
    row = runner.req_to_token_pool.alloc()
    assert row is not None
    runner.req_to_token_pool.write(row, 0, torch.arange(prompt_len))
    prompt = _prompts(1, prompt_len, vocab)[0]
    seconds = best_time(lambda: runner.forward(runner.build_batch([row], [0], [prompt])))
    result["prefill"] = prompt_len / seconds
    runner.req_to_token_pool.free(row)
    for batch in batches:
        rows = [runner.req_to_token_pool.alloc() for _ in range(batch)]
        span = prompt_len + steps
        for i, r in enumerate(rows):
            assert r is not None
            runner.req_to_token_pool.write(r, 0, torch.arange(i * span, (i + 1) * span))
        live = [r for r in rows if r is not None]
        prompts = _prompts(batch, prompt_len, vocab)
        logits = runner.forward(runner.build_batch(live, [0] * batch, prompts))

        def decode(first: torch.Tensor = logits, rows: list[int] = live) -> None:
            ids = first.argmax(-1).tolist()
            for step in range(steps):
                out = runner.forward(
                    runner.build_batch(rows, [prompt_len + step] * len(rows), [[t] for t in ids])
                )
                ids = out.argmax(-1).tolist()

        result[f"decode_b{batch}"] = batch * steps / best_time(decode, repeat=2)
        for r in live:
            runner.req_to_token_pool.free(r)
    return result


def llama_cpp(gguf: str, prompt_len: int, steps: int, vocab: int) -> dict[str, float]:
    llm = open_llama(
        gguf, n_ctx=prompt_len + steps + 16, n_batch=max(512, prompt_len),
        n_threads=torch.get_num_threads(), verbose=False, logits_all=False,
    )  # fmt: skip
    prompt = _prompts(1, prompt_len, vocab)[0]

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    result = {"prefill": prompt_len / best_time(prefill)}

    def decode_seconds() -> float:
        """Seconds for ``steps`` greedy tokens after a fresh prefill (the prefill untimed)."""
        llm.reset()
        llm.eval(prompt)
        token = prompt[-1]
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([token])
            token = int(llm.scores[llm.n_tokens - 1].argmax())
        return time.perf_counter() - start

    best = min(decode_seconds() for _ in range(3))
    result["decode_b1"] = steps / best
    return result


def llama_server(gguf: str, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens/s of ``prompts`` (equal lengths) on llama-server with a slot each: the
    sum of the slots' own rates (BuildError when there is no binary and none can be built)."""
    config = ServerConfig(
        find_or_build(None), Path(gguf), len(prompts), len(prompts[0]) + steps + 64,
        torch.get_num_threads(), free_port(), extra_flags=tuple(server_flags(gguf)),
    )  # fmt: skip

    async def run() -> float:
        async with httpx.AsyncClient(base_url=config.url, timeout=None) as client:
            body = {"n_predict": steps, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False}  # fmt: skip
            answers = await asyncio.gather(
                *(client.post("/completion", json={**body, "prompt": p}) for p in prompts)
            )
        rates = [a.json()["timings"]["predicted_per_second"] for a in answers]
        return float(sum(rates))

    with LlamaServer(config.command(), config.url):
        asyncio.run(run())  # warm-up
        return max(asyncio.run(run()) for _ in range(2))


def real_model(args: argparse.Namespace, batches: list[int]) -> None:
    """The three systems on ``args.model_path``, each in its own process, ``args.rounds``
    times interleaved; prints the table and writes the JSON."""
    model_path = str(Path(args.model_path).expanduser().resolve())
    locate_model(model_path)  # builds a GGUF file's converted folder once, before any timing
    gguf = str(llama_cpp_file(model_path))
    spec = _spec(args, model_path, gguf, batches)
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if systems[:1] != ("arbor",) or len(systems) < 2:
        raise SystemExit(f"--systems: arbor and at least one of {', '.join(SYSTEMS[1:])}")
    load_before = os.getloadavg()
    no_server = ""
    try:
        if "llama.cpp" in systems and any(b > 1 for b in batches):
            find_or_build(None)  # once: a failed build is not retried every round
    except BuildError as exc:
        no_server = f"llama-server unavailable: {exc}"
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        rounds.append({system: _run_worker(system, spec) for system in systems})
        if "llama.cpp" in systems:
            server = _server_rates(gguf, spec, batches, args.steps, no_server)
            rounds[-1]["llama.cpp"].update(server)
        print(f"round {number + 1}:", json.dumps(rounds[-1]), flush=True)
    best = {system: _best([r[system] for r in rounds]) for system in systems}
    load_after = os.getloadavg()
    rows = _table_rows(best, batches, systems)
    print(f"\n{model_path}: {args.rounds} round(s), best of each, {spec['threads']} threads; "
          f"arbor --dtype {args.dtype} --quantization {args.quantization}; load average "
          f"before {_load(load_before)}, after {_load(load_after)}\n")  # fmt: skip
    print_table(["", *systems, *(f"arbor / {other}" for other in systems[1:])], rows)
    for system, result in best.items():
        for key, value in result.items():
            if isinstance(value, str):
                print(f"  {system} {key}: {value}")
    no_extra_buffers = extra_buffers_crash(gguf)
    if no_extra_buffers:
        print(f"  llama.cpp: {NO_EXTRA_BUFFERS_NOTE}")
    payload = {
        "model_path": model_path, "gguf": gguf, "prompt_len": spec["prompt_len"],
        "batch_context": args.batch_context, "steps": args.steps, "batches": batches,
        "threads": spec["threads"], "dtype": args.dtype, "quantization": args.quantization,
        "rounds": rounds, "best": best,
        "llama_cpp_extra_buffers_off": no_extra_buffers,
        "load_average": {"before": load_before, "after": load_after},
        "command": ["python", "-m", "benchmarks.cpu_anchor_bench", *sys.argv[1:]],
    }  # fmt: skip
    write_json("cpu_anchor_bench_model", payload, args.out)


def _spec(
    args: argparse.Namespace, model_path: str, gguf: str, batches: list[int]
) -> dict[str, Any]:
    """What every worker runs: the single-stream prompt (the passage's first ``prompt_len``
    tokens, repeated if short) and ``batch`` prompts of ``batch_context`` tokens at different
    offsets into it."""
    ids = load_tokenizer(model_path)(ENGLISH_PASSAGE.read_text()).input_ids
    prompt_len = args.prompt_len or 512
    batch = max(batches)
    text = ids * (prompt_len // len(ids) + 1)
    stride = max(1, (len(ids) - args.batch_context) // max(batch, 1))
    batch_prompts = [
        text[i * stride : i * stride + args.batch_context] for i in range(batch)
    ]  # fmt: skip
    return {
        "model_path": model_path, "gguf": gguf, "prompt": text[:prompt_len],
        "prompt_len": prompt_len, "steps": args.steps, "repeat": 3,
        "batch_prompts": batch_prompts if batch > 1 else [], "batches": batches,
        "threads": torch.get_num_threads(), "dtype": args.dtype,
        "quantization": args.quantization,
    }  # fmt: skip


def _server_rates(
    gguf: str, spec: dict[str, Any], batches: list[int], steps: int, no_server: str
) -> dict[str, float | str]:
    """llama.cpp's batch decode rates, from llama-server (or why there are none)."""
    rates: dict[str, float | str] = {}
    for batch in (b for b in batches if b > 1):
        key = f"decode_b{batch}"
        if no_server:
            rates[key] = no_server
            continue
        try:
            rates[key] = llama_server(gguf, spec["batch_prompts"][:batch], steps)
        except (BuildError, ServerError, OSError) as exc:
            rates[key] = f"llama-server unavailable: {exc}"
    return rates


def _run_worker(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """``system``'s measurements from a fresh process, or ``{"unavailable": reason}``."""
    if system == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return {"unavailable": "llama_cpp not importable: pip install llama-cpp-python "
                "(builds from source, ~9 min)"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        command = [sys.executable, "-m", "benchmarks.cpu_anchor_worker", system]
        done = subprocess.run(
            [*command, str(spec_file), str(out_file)], capture_output=True, text=True
        )
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            return {"unavailable": f"worker exited with {done.returncode}: {tail}"}
        return dict(json.loads(out_file.read_text()))


def _best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's best over the rounds: the lowest time and memory, the highest rate, and
    the highest share of the CPU others took (the worst round's); a number beats a reason."""
    best: dict[str, Any] = {}
    for result in results:
        for key, value in result.items():
            old = best.get(key)
            if isinstance(value, float) and isinstance(old, float):
                best[key] = (min if key in LOWER_IS_BETTER else max)(old, value)
            elif not isinstance(old, float):
                best[key] = value
    return best


def _table_rows(
    best: dict[str, dict[str, Any]], batches: list[int], systems: tuple[str, ...] = SYSTEMS
) -> list[list[Any]]:
    labels = {
        "load_s": "load s", "rss_load_mb": "RSS after load, MB",
        "rss_peak_mb": "peak RSS of load, MB", "rss_run_mb": "RSS after 1-stream runs, MB",
        "prefill": "prefill tok/s", "decode_b1": "decode tok/s, 1 stream",
        **{f"decode_b{b}": f"decode tok/s, batch {b}" for b in batches if b > 1},
        "others_cpu_share": "others' CPU (worst round)",
    }  # fmt: skip
    rows = []
    for key, label in labels.items():
        values = [best[s].get(key, "-") for s in systems]
        cells = [v if isinstance(v, float) else "n/a" if isinstance(v, str) else v for v in values]
        if key == "others_cpu_share":
            cells = [f"{v:.0%}" if isinstance(v, float) else v for v in cells]
        ours = values[0]
        ratios = [
            f"{ours / v:.2f}x" if isinstance(ours, float) and isinstance(v, float) and v else "-"
            for v in values[1:]
        ]
        rows.append([label, *cells, *(ratios if key != "others_cpu_share" else [""] * len(ratios))])
    return rows


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b-shape")
    parser.add_argument(
        "--model-path", help="a GGUF file (or model folder): Arbor, transformers and llama.cpp "
        "on it, instead of Arbor and llama.cpp on the preset",
    )  # fmt: skip
    parser.add_argument("--batches", help="decode batch sizes (default 1,8,32)")
    parser.add_argument("--prompt-len", type=int, help="default 128 (model: 512)")
    parser.add_argument("--batch-context", type=int, default=128, help="model: batch prompts")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="model: rounds, best kept")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="model: which systems run, comma-separated (arbor and at least one other)",
    )
    parser.add_argument(
        "--quantization", default="auto", choices=("auto", "none", "gguf"),
        help="model: Arbor's --quantization (none: dequantized to --dtype; gguf: the blocks)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="model: Arbor's --dtype")
    parser.add_argument("--out", help="JSON results path")
    args = parser.parse_args()
    batches = [int(b) for b in (args.batches or "1,8,32").split(",")]
    if args.model_path:
        real_model(args, batches)
        return
    prompt_len = args.prompt_len or 128
    model = str(cached_test_model(args.preset, "llama"))
    kernels.set_kernel_backend("auto")
    ours = arbor(model, batches, prompt_len, args.steps)
    print("arbor", ours, flush=True)
    gguf = str(converted(model))
    vocab = _vocab(model)
    theirs = llama_cpp(gguf, prompt_len, args.steps, vocab)
    for batch in batches:
        if batch > 1:
            theirs[f"decode_b{batch}"] = llama_server(
                gguf, _prompts(batch, prompt_len, vocab), args.steps
            )
    print("llama.cpp", theirs, flush=True)
    rows = [
        [key, round(ours[key], 1), round(theirs[key], 1), f"{ours[key] / theirs[key]:.2f}x"]
        for key in ours
    ]
    print_table(["tokens/s", "arbor", "llama.cpp", "arbor / llama.cpp"], rows)
    payload = {"preset": args.preset, "prompt_len": prompt_len, "steps": args.steps,
               "arbor": ours, "llama_cpp": theirs}  # fmt: skip
    write_json("cpu_anchor_bench", payload, args.out)


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    main()
