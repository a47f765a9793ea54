"""What this CPU can do, read from its flags, and the choices made from them.

The CPUs these runs meet differ (docs/benchmarks.md): an Intel Xeon with AVX-512 but no
AVX512-BF16 ran bfloat16 matmuls 2-2.5x slower than float32, while on one with it
(``vdpbf16ps``: bfloat16 products summed in float32; and AMX) oneDNN's packed bfloat16 GEMMs
ran SmolLM2's larger projections 1.9-6x faster than packed float32 at 1-32 rows and 3.5-7x at
512 (benchmarks/bf16_bench.py, docs/benchmarks.md). So bfloat16 weights are only packed for
oneDNN, and only chosen by ``--dtype auto``, where the flag is present. Callers pass the flags
in (tests inject them); ``cpu_flags()`` reads this machine's.
"""

from __future__ import annotations

import functools
from pathlib import Path

# The flag that says the CPU has bfloat16 dot products with float32 accumulation.
BF16_DOT_FLAG = "avx512_bf16"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags from /proc/cpuinfo (empty where there is none to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_bf16_dot(flags: frozenset[str]) -> bool:
    """Whether a CPU with ``flags`` runs bfloat16 dot products natively (float32 sums)."""
    return BF16_DOT_FLAG in flags


def auto_cpu_dtype(checkpoint_dtype: str, flags: frozenset[str]) -> str:
    """The dtype ``--dtype auto`` computes in on a CPU with ``flags`` for a checkpoint stored in
    ``checkpoint_dtype`` (a ``runtime.model_config`` dtype name): a bfloat16 checkpoint stays
    bfloat16 where the CPU has bfloat16 dot products (half the weight bytes per token, and the
    faster GEMMs); everything else computes in float32."""
    if checkpoint_dtype == "bfloat16" and has_bf16_dot(flags):
        return "bfloat16"
    return "float32"
