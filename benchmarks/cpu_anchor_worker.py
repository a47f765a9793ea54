"""One system's measurements for ``cpu_anchor_bench --model-path``, in a process of its own.

Each system loads the model in a fresh process, so that one system's memory (a freed but
not returned heap, a mapped file) never counts against another and each starts cold. The
worker reads a spec (the model, the prompts, the step count: the same for every system),
measures and writes one JSON object:

- ``load_s``: constructing the model object (Arbor: the ``Engine``), from the file to ready
  to run;
- ``rss_load_mb``: resident memory growth over that (VmRSS after minus before; imports and
  the tokenizer are before), ``rss_peak_mb`` the peak during it (VmHWM after minus VmRSS
  before), ``rss_run_mb`` the growth once the single-stream runs are done (llama.cpp maps
  its file and counts those pages only once a forward has read them);
- ``prefill``: tokens/s of one forward over the prompt (logits for its last token only;
  Arbor: a request for one greedy token);
- ``decode_b1``: greedy tokens/s of one sequence after the prompt, the prompt untimed;
- ``decode_bB`` for each B of ``batches`` above 1: tokens/s of B sequences decoding together
  (the first B ``batch_prompts``), their prompts untimed (Arbor and transformers; llama.cpp's
  batches run on llama-server, which the parent process starts);
- ``others_cpu_share``: the machine's CPU other processes used while this one measured;
- Arbor also reports the ``dtype`` and ``quantization`` it ran with (auto resolved).

Rates are the best of ``repeat`` runs after a warm-up (benchmarks.common.best_time).

    python -m benchmarks.cpu_anchor_worker arbor|transformers|llama.cpp SPEC.json OUT.json
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import arbor_kernels as kernels
import torch

from benchmarks.common import best_time
from benchmarks.suite.contention import others_share, sample
from benchmarks.suite.systems.arbor import stream_call
from benchmarks.suite.systems.llama_cpp_load import extra_buffers_crash, open_llama
from benchmarks.suite.systems.model_source import load_hf_model
from benchmarks.suite.trace import Clock, Timing
from runtime import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class SystemRuns(Protocol):
    def prefill(self, prompt: list[int]) -> None: ...

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds of ``steps`` greedy steps of all ``prompts`` (equal lengths) together,
        after their prefill (untimed)."""
        ...

    def for_batch(self, prompts: list[list[int]], steps: int) -> SystemRuns:
        """Runs that hold ``prompts`` and their ``steps`` tokens (may be this one)."""
        ...


def memory_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def measure(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Load ``spec["model_path"]`` as ``system`` and measure it (the module docstring)."""
    load = _loader(system, spec["gguf"])
    gc.collect()
    rss_before, _ = memory_mb()
    start = time.perf_counter()
    runs = load(spec)
    result: dict[str, Any] = {"load_s": time.perf_counter() - start}
    rss, peak = memory_mb()
    result.update(rss_load_mb=rss - rss_before, rss_peak_mb=peak - rss_before)
    cpu_start = sample()
    prompt, steps, repeat = spec["prompt"], spec["steps"], spec["repeat"]
    result["prefill"] = len(prompt) / best_time(lambda: runs.prefill(prompt), repeat)
    result["decode_b1"] = steps / min(runs.decode_seconds([prompt], steps) for _ in range(repeat))
    result["rss_run_mb"] = memory_mb()[0] - rss_before
    batch_prompts = spec["batch_prompts"]
    batches = [b for b in spec["batches"] if b > 1]
    if batch_prompts and batches and system != "llama.cpp":
        runs = runs.for_batch(batch_prompts, steps)
        for batch in batches:
            prompts = batch_prompts[:batch]
            best = min(runs.decode_seconds(prompts, steps) for _ in range(repeat))
            result[f"decode_b{batch}"] = batch * steps / best
    result["others_cpu_share"] = others_share(cpu_start, sample())
    result.update(getattr(runs, "settings", {}))
    return result


def _loader(system: str, gguf_path: str) -> Callable[[dict[str, Any]], SystemRuns]:
    """The system's constructor, with the modules its load will import already imported and
    llama.cpp's buffer probe done (so that neither counts as the model's load)."""
    if system == "arbor":
        kernels.set_kernel_backend("auto")
        return ArborRuns
    if system == "transformers":
        import gguf  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: F401

        return TransformersRuns
    if system == "llama.cpp":
        import llama_cpp  # noqa: F401

        extra_buffers_crash(gguf_path)  # the probe's child process, before the baseline
        return LlamaCppRuns
    raise SystemExit(f"unknown system {system!r}; choose arbor, transformers or llama.cpp")


class ArborRuns:
    """Arbor as a user runs it: a ``runtime.Engine`` on the file (``dtype`` and
    ``quantization`` from the spec; the defaults are Arbor's own), its scheduler, sampling and
    streaming included, as llama.cpp's own loop is measured. The prefix cache is off, so that
    every repeat computes its prompt."""

    def __init__(self, spec: dict[str, Any]) -> None:
        # The pool holds the single stream, or the largest batch of (shorter) batch prompts.
        room, batch_prompts = spec["steps"] + 8, spec["batch_prompts"]
        sequences = max([1, *spec["batches"]])
        batch_tokens = sequences * (len(batch_prompts[0]) + room) if batch_prompts else 0
        self.engine = Engine(
            spec["model_path"], dtype=spec["dtype"], quantization=spec["quantization"],
            max_total_tokens=max(len(spec["prompt"]) + room, batch_tokens) + 64,
            max_running_requests=sequences,
            disable_radix_cache=True, device="cpu",
        )  # fmt: skip
        info = self.engine.get_server_info()
        # What auto resolved to, reported beside the numbers.
        self.settings = {key: str(info[key]) for key in ("dtype", "quantization")}

    def for_batch(self, prompts: list[list[int]], steps: int) -> SystemRuns:
        return self

    def prefill(self, prompt: list[int]) -> None:
        self.engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 1})

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds per ``steps`` tokens of each prompt while all of them decode: tokens that
        reach the client between the last first token (every prefill done) and the last
        token, scaled to ``len(prompts) * steps``."""

        async def run() -> list[Timing]:
            clock = Clock()
            sampling = {**GREEDY, "max_new_tokens": steps + 1}
            calls = [stream_call(self.engine, clock, tuple(p), sampling) for p in prompts]
            return [timing for _, timing, _ in await asyncio.gather(*calls)]

        timings = asyncio.run(run())
        start = max(t.token_times[0] for t in timings)
        end = max(t.token_times[-1] for t in timings)
        emitted = sum(start < when <= end for t in timings for when in t.token_times)
        return (end - start) * len(prompts) * steps / max(emitted, 1)


class TransformersRuns:
    """transformers' ``AutoModelForCausalLM`` on the file (``gguf_file=``: dequantized to
    float32), stepped by hand with its KV cache, as ``generate`` does minus its sampling."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.model = load_hf_model(spec["model_path"])

    def for_batch(self, prompts: list[list[int]], steps: int) -> SystemRuns:
        return self

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        out = self.model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(steps):
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            out = self.model(ids, cache=out.cache, use_cache=True)
        return time.perf_counter() - start


class LlamaCppRuns:
    """llama-cpp-python's ``Llama`` on the file as it is (its own quantized kernels), one
    sequence, its defaults otherwise (f16 KV cache; extra buffer types where they run:
    llama_cpp_load.py), Arbor's thread count."""

    def __init__(self, spec: dict[str, Any]) -> None:
        threads = torch.get_num_threads()
        context = len(spec["prompt"]) + spec["steps"] + 16
        # n_batch is also the rows of Llama.scores, which must hold every decoded position
        self.llm = open_llama(
            spec["gguf"], n_ctx=context, n_batch=context, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip

    def for_batch(self, prompts: list[list[int]], steps: int) -> SystemRuns:
        raise NotImplementedError("llama.cpp batches run on llama-server")

    def prefill(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        (prompt,) = prompts
        self.prefill(prompt)
        start = time.perf_counter()
        for _ in range(steps):
            token = int(self.llm.scores[self.llm.n_tokens - 1].argmax())
            self.llm.eval([token])
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    system, spec_path, out_path = argv or sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result = measure(system, spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
