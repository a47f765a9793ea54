"""Single-token GEMV speed of a GGUF file's quantized layers against a plain read of their bytes.

    python -m benchmarks.gemv_roofline [--model-path FILE.gguf] [--repeat 20] [--out JSON]

A decode step reads every weight once, so a single stream's speed is bounded by how fast the
machine reads bytes. This probe loads the file as Arbor runs it (``--quantization gguf``: the
blocks packed for the native kernels, ``arbor_kernels.quantized.pack``), groups its quantized
layers by packed format (code bits, block size, the activations' rounding), and times
``quantized_linear`` at M = 1 over each group's layers in turn (so the group's bytes stream from
memory as in a step). The roofline is a plain read of as many bytes on the same machine and
threads: ``torch.sum`` over an int64 buffer of the group's size, also read once per pass. The
table gives each format's bytes, bits per weight as held, GB/s, and its share of the roofline;
the GGUF tensor types the file holds are listed above it (a type whose blocks unpack to 8-bit
codes, as Q5_0 and Q6_K do today, reads more bytes than the file holds). CPU named in every row.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from typing import Any

import arbor_kernels as kernels
import torch
from arbor_kernels.quantized import QuantizedWeight

from benchmarks.common import cpu_description, print_table, write_json
from runtime.layers.quantized import QuantizedEmbedding, QuantizedLinear
from runtime.model_files import resolve_model_path
from runtime.model_runner import ModelRunner, RunnerConfig


def packed_weights(model: torch.nn.Module) -> dict[str, list[QuantizedWeight]]:
    """The model's packed weights by format (the tied head's included)."""
    groups: dict[str, list[QuantizedWeight]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            weights = [p for p in module.pieces if isinstance(p, QuantizedWeight)]
        elif isinstance(module, QuantizedEmbedding):
            weights = [module.weight_blocks]
        else:
            continue
        for weight in weights:
            label = f"{weight.bits}-bit codes, block {weight.block}, {weight.activations}"
            groups[label].append(weight)
    return groups


def best_seconds(fn: Any, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gguf_types(path: str) -> Counter[str]:
    from gguf import GGUFReader

    return Counter(tensor.tensor_type.name for tensor in GGUFReader(path).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="a GGUF file (default: the built-in model)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = resolve_model_path(args.model_path)
    cpu = cpu_description()
    runner = ModelRunner(
        RunnerConfig(path, quantization="gguf", kv_slots=64, max_requests=1, context_len=64)
    )
    rows, results = [], []
    for label, weights in sorted(packed_weights(runner.model).items()):
        inputs = [torch.randn(1, weight.k) for weight in weights]
        nbytes = sum(weight.nbytes() for weight in weights)
        values = sum(weight.n * weight.k for weight in weights)

        def gemv(weights: list[QuantizedWeight] = weights, inputs: list = inputs) -> None:
            for weight, x in zip(weights, inputs, strict=True):
                kernels.quantized_linear(x, weight, None)

        plain = torch.randint(0, 1 << 20, (nbytes // 8,), dtype=torch.int64)
        gemv_s = best_seconds(gemv, args.repeat)
        read_s = best_seconds(lambda plain=plain: plain.sum(), args.repeat)
        gemv_gbs, read_gbs = nbytes / gemv_s / 1e9, plain.numel() * 8 / read_s / 1e9
        row = {
            "format": label,
            "layers": len(weights),
            "MB": nbytes / 1e6,
            "bits/weight": 8 * nbytes / values,
            "GEMV GB/s": gemv_gbs,
            "plain read GB/s": read_gbs,
            "share of roofline": gemv_gbs / read_gbs,
            "cpu": cpu,
        }
        results.append(row)
        rows.append([*(row[k] for k in list(row)[:-2]), f"{row['share of roofline']:.0%}"])
    types = gguf_types(path)
    held = ", ".join(f"{name} x{count}" for name, count in sorted(types.items()))
    print(f"\n{path}\n{cpu}; GGUF tensor types: {held}\n")
    print_table(
        ["format (as packed)", "layers", "MB", "bits/weight", "GEMV GB/s", "plain read GB/s",
         "share"],
        rows,
    )  # fmt: skip
    write_json(
        "gemv_roofline", {"model_path": path, "cpu": cpu, "gguf_types": types, "rows": results},
        args.out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
