"""Speed on the GPU: the kernel benchmarks of ``benchmarks.kernel_bench``, and Engine decode
throughput of the ``qwen2.5-0.5b-shape`` model with CUDA graphs on and off. Reported, never
failed on; a benchmark that raises is an ``error`` line of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks import kernel_bench
from benchmarks.common import best_time
from benchmarks.gpu_check.checks import INFO, SKIPPED, Check, Deadline, Row, error_check
from benchmarks.gpu_check.engine_checks import cuda_graph_fields, release_memory
from runtime import Engine
from runtime.test_model import cached_test_model

THROUGHPUT_MODEL = ("qwen2.5-0.5b-shape", "qwen2")
Tables = dict[str, list[Row]]


def run_kernel_bench(deadline: Deadline) -> tuple[list[Check], Tables]:
    """kernel_bench's GPU sections in bfloat16; ``quick`` sizes when under four minutes remain."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    quick = deadline.left() < 240
    peak = kernel_bench._peak_bandwidth(device)
    copy = kernel_bench._copy_bandwidth(device)
    checks = [
        Check(
            "HBM bandwidth",
            INFO,
            f"1 GiB copy {copy / 1e9:,.0f} GB/s; datasheet peak "
            + (f"{peak / 1e9:,.0f} GB/s" if peak else "unknown for this device"),
            gating=False,
            metrics={"copy_bytes_per_s": copy, "peak_bytes_per_s": peak},
        )
    ]
    benches: dict[str, Callable[[], list[Row]]] = {
        "decode attention": lambda: kernel_bench.bench_decode(device, dtype, quick),
        "extend attention": lambda: kernel_bench.bench_extend(device, dtype, quick),
        "token bitmask": lambda: kernel_bench.bench_bitmask(device, quick),
        "sampling": lambda: kernel_bench.bench_sampling(device, quick),
        "elementwise": lambda: kernel_bench.bench_elementwise(device, dtype),
    }
    tables: Tables = {}
    for title, bench in benches.items():
        name = f"kernel_bench {title}"
        if deadline.left() < 20:
            checks.append(Check(name, SKIPPED, "out of time", gating=False))
            continue
        try:
            tables[f"{title} (bfloat16{', quick' if quick else ''})"] = bench()
        except Exception as exc:
            checks.append(error_check(name, exc, gating=False))
    return checks, tables


def _variants() -> list[tuple[str, dict[str, Any]]]:
    """(label, Engine keyword arguments): triton with and without CUDA graphs when the runner
    has them, and the torch kernels for comparison."""
    fields = cuda_graph_fields()
    if "disable_cuda_graph" not in fields:
        return [("triton", {"kernel_backend": "triton"}), ("torch", {"kernel_backend": "torch"})]
    graphs: dict[str, Any] = {"kernel_backend": "triton", "disable_cuda_graph": False}
    if "cuda_graph_max_bs" in fields:
        graphs["cuda_graph_max_bs"] = 64
    eager = {"disable_cuda_graph": True}
    return [
        ("triton, CUDA graphs", graphs),
        ("triton, eager", {"kernel_backend": "triton", **eager}),
        ("torch, eager", {"kernel_backend": "torch", **eager}),
    ]


def decode_tokens_per_s(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s at ``batch`` requests: a run of ``new_tokens`` minus a run of one token,
    so prefill and the first token cancel out (best of two runs after a warm-up, each). Raises
    when the difference is not positive (too few tokens for the timing noise: no number is
    better than a wrong one)."""
    ids = [[(31 * b + 7 * j) % 5000 + 100 for j in range(prompt_len)] for b in range(batch)]

    def run(n: int) -> float:
        params = {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}
        return best_time(lambda: engine.generate(input_ids=ids, sampling_params=params), 2)

    decode_s = run(new_tokens) - run(1)
    if decode_s <= 0:
        raise RuntimeError(f"{new_tokens} tokens took no longer than one: timing noise")
    return batch * (new_tokens - 1) / decode_s


def run_engine_throughput(deadline: Deadline) -> tuple[list[Check], Tables]:
    """Decode tokens/s at batch 1 and 64, bfloat16, prompts of 128 tokens, per variant."""
    preset, arch = THROUGHPUT_MODEL
    path = str(cached_test_model(preset, arch))
    new_tokens = 128 if deadline.left() > 150 else 32
    checks: list[Check] = []
    rows: list[Row] = []
    for label, kwargs in _variants():
        name = f"engine decode {label}"
        if deadline.left() < 45:
            checks.append(Check(name, SKIPPED, "out of time", gating=False))
            continue
        try:
            with Engine(
                path, device="cuda", dtype="bfloat16", page_size=16,
                max_total_tokens=64 * 512, disable_radix_cache=True, **kwargs,
            ) as engine:  # fmt: skip
                for batch in (1, 64):
                    tok_s = decode_tokens_per_s(engine, batch, 128, new_tokens)
                    rows.append({"case": f"{preset} B={batch}", "kernels": label,
                                 "new tokens": new_tokens, "decode tok/s": tok_s})  # fmt: skip
        except Exception as exc:
            checks.append(error_check(name, exc, gating=False))
        release_memory()
    return checks, {f"engine decode ({preset}, bfloat16)": rows}
