"""One system's measurements for ``cpu_anchor_bench --model-path``, in a process of its own.

Each system loads the model in a fresh process, so that one system's memory (a freed but
not returned heap, a mapped file) never counts against another and each starts cold. The
worker reads a spec (the model, the prompts, the step count: the same for every system),
measures and writes one JSON object:

- ``load_s``: constructing the model object, from the file to ready to run;
- ``rss_load_mb``: resident memory growth over that (VmRSS after minus before; imports and
  the tokenizer are before), ``rss_peak_mb`` the peak during it (VmHWM after minus VmRSS
  before), ``rss_run_mb`` the growth once the single-stream runs are done (llama.cpp maps
  its file and counts those pages only once a forward has read them);
- ``prefill``: tokens/s of one forward over the prompt (logits for its last token only);
- ``decode_b1``: greedy tokens/s of one sequence after the prompt, the prompt untimed;
- ``decode_bB``: tokens/s of B sequences decoding together (``batch_prompts``), their
  prompts untimed (Arbor and transformers; llama.cpp's batches run on llama-server, which
  the parent process starts);
- ``others_cpu_share``: the machine's CPU other processes used while this one measured.

Rates are the best of ``repeat`` runs after a warm-up (benchmarks.common.best_time).

    python -m benchmarks.cpu_anchor_worker arbor|transformers|llama.cpp SPEC.json OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

import kernels
from benchmarks.common import best_time
from benchmarks.suite.contention import others_share, sample
from benchmarks.suite.systems.llama_cpp_load import extra_buffers_crash, open_llama
from benchmarks.suite.systems.model_source import load_hf_model
from runtime.model_runner import ModelRunner, RunnerConfig


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
    if batch_prompts and system != "llama.cpp":
        runs = runs.for_batch(batch_prompts, steps)
        best = min(runs.decode_seconds(batch_prompts, steps) for _ in range(repeat))
        result[f"decode_b{len(batch_prompts)}"] = len(batch_prompts) * steps / best
    result["others_cpu_share"] = others_share(cpu_start, sample())
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
    """Arbor's model runner on the file, weights dequantized to float32
    (``quantization="none"``), its KV pool sized for the runs at hand."""

    def __init__(self, spec: dict[str, Any], sequences: int = 1, context: int = 0) -> None:
        self.spec = spec
        context = context or len(spec["prompt"]) + spec["steps"] + 8
        self.runner = ModelRunner(RunnerConfig(
            spec["model_path"], dtype="float32", quantization="none",
            kv_slots=sequences * context + 8, max_requests=sequences, context_len=context,
        ))  # fmt: skip

    def for_batch(self, prompts: list[list[int]], steps: int) -> SystemRuns:
        """A runner whose pool holds ``prompts`` and their ``steps`` tokens (this one freed)."""
        spec = self.spec
        del self.runner
        gc.collect()
        return ArborRuns(spec, len(prompts), len(prompts[0]) + steps + 8)

    def _rows(self, count: int, span: int) -> list[int]:
        rows = [self.runner.req_to_token_pool.alloc() for _ in range(count)]
        for i, row in enumerate(rows):
            assert row is not None
            slots = torch.arange(1 + i * span, 1 + (i + 1) * span)  # slot 0: the padding slot
            self.runner.req_to_token_pool.write(row, 0, slots)
        return [r for r in rows if r is not None]

    def prefill(self, prompt: list[int]) -> None:
        rows = self._rows(1, len(prompt))
        self.runner.forward(self.runner.build_batch(rows, [0], [prompt]))
        self.runner.req_to_token_pool.free(rows[0])

    def decode_seconds(self, prompts: list[list[int]], steps: int) -> float:
        length = len(prompts[0])
        rows = self._rows(len(prompts), length + steps)
        logits = self.runner.forward(self.runner.build_batch(rows, [0] * len(rows), prompts))
        start = time.perf_counter()
        for step in range(steps):
            ids = logits.argmax(-1).tolist()
            batch = self.runner.build_batch(rows, [length + step] * len(rows), [[t] for t in ids])
            logits = self.runner.forward(batch)
        seconds = time.perf_counter() - start
        for row in rows:
            self.runner.req_to_token_pool.free(row)
        return seconds


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
