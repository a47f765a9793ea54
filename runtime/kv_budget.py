"""How big the KV pool is when no flag says, and whether a size a flag asks for fits here.

On a GPU the default pool takes ``DEFAULT_GPU_MEM_FRACTION`` of the memory free after the
weights: the device is the server's. On a CPU the machine is shared (a laptop runs a browser
beside the server), so the default pool holds what the server can use, every request row
filled to the context length (``max_running_requests x context_length`` tokens), capped at
``DEFAULT_CPU_KV_BYTES`` of K/V over all ranks. The pool's pages are committed by the OS as
tokens are written (``runtime.memory_pool``), so the cap bounds what the cache grows to, not
what the server takes at start. An explicit ``--mem-fraction-static`` or ``--max-total-tokens``
is taken as given, but one this machine's available memory cannot hold is refused at start
(``check_kv_fits``). Torch-free: the HTTP process checks flags before any process starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.model_files import locate_model

if TYPE_CHECKING:  # runtime.server_args reads this module's defaults for its help text
    from runtime.model_config import ModelConfig
    from runtime.server_args import ServerArgs

# The default CPU pool's cap: 1 GiB of K/V (SmolLM2-135M in float32: 23,302 tokens).
DEFAULT_CPU_KV_BYTES = 1 << 30
# The default GPU pool: this fraction of the device memory free once the weights are loaded.
DEFAULT_GPU_MEM_FRACTION = 0.3
# Bytes per element of each ``--kv-cache-dtype`` (``auto`` resolved by ServerArgs.for_device).
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class KVMemoryError(ValueError):
    """A KV pool size a flag asks for that this machine's memory cannot hold."""


def default_cpu_kv_slots(
    max_requests: int, context_len: int, bytes_per_token: int, page_size: int, ranks: int = 1
) -> int:
    """Token slots of one rank's default CPU pool (``ranks`` share the machine and the cap):
    ``max_requests * context_len``, at most ``DEFAULT_CPU_KV_BYTES / ranks`` of K/V, in whole
    pages, plus the padding page the allocator never hands out (page 0)."""
    usable = min(max_requests * context_len, DEFAULT_CPU_KV_BYTES // ranks // bytes_per_token)
    pages = max(1, usable // page_size)
    return (pages + 1) * page_size


def available_memory_bytes() -> int:
    """Memory the kernel says can be given to a new process without swapping (MemAvailable),
    or the free pages where /proc/meminfo has no such line."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str) -> int:
    """K and V over all layers and all KV heads for one token (``kv_cache_dtype`` named:
    fp32, bf16 or fp16)."""
    heads = config.num_kv_heads * config.head_dim
    return 2 * config.num_layers * heads * KV_DTYPE_BYTES[kv_cache_dtype]


def check_kv_fits(
    args: ServerArgs,
    config: ModelConfig,
    available: int | None = None,
    total: int | None = None,
) -> None:
    """Raise KVMemoryError naming the flag unless the pool ``args`` ask for fits in
    ``available`` bytes (default: this machine's now). ``args`` have their device defaults
    filled in (``for_device``) and run on the CPU; ``--max-total-tokens`` needs its K/V (each
    ``--dp`` replica on this machine its own pool), ``--mem-fraction-static`` its fraction of
    ``total`` memory (default: this machine's), which the weights and the pool share. Flags
    left at their defaults pass: the default pool is capped (``DEFAULT_CPU_KV_BYTES``)."""
    available = available_memory_bytes() if available is None else available
    total = total_memory_bytes() if total is None else total
    replicas = args.dp_size if args.ray_address is None else 1
    if args.max_total_tokens is not None:
        flag = f"--max-total-tokens {args.max_total_tokens}"
        per_token = kv_bytes_per_token(config, args.kv_cache_dtype)
        needed = args.max_total_tokens * per_token * replicas
        what = "of KV memory"
    elif args.mem_fraction_static is not None:
        flag = f"--mem-fraction-static {args.mem_fraction_static:g}"
        needed = int(total * args.mem_fraction_static)
        what = "for the weights and the KV pool"
    else:
        return
    if needed > available:
        raise KVMemoryError(
            f"{flag} needs {_gb(needed)} {what}; this machine has {_gb(available)} available"
        )


def check_server_kv(args: ServerArgs) -> None:
    """``check_kv_fits`` for a server about to start with ``args`` on this machine, before any
    process starts (ModelLoadError for a model whose config cannot be read). Only on a CPU:
    ``--device auto`` on a machine without an NVIDIA driver, or ``cpu``; a GPU's pool is sized
    against the device by the scheduler."""
    on_cpu = args.device == "cpu" or (
        args.device == "auto" and not Path("/proc/driver/nvidia/version").exists()
    )
    if not on_cpu:
        return
    from runtime.cpu_features import cpu_flags
    from runtime.model_config import ModelConfig, stored_dtype

    config = ModelConfig.from_pretrained(args.model_path)
    stored = stored_dtype(locate_model(args.model_path).config())
    check_kv_fits(args.for_device(False, stored, cpu_flags()), config)


def check_pool_fits(slots: int, pool_bytes: int, available: int | None = None) -> None:
    """Raise KVMemoryError unless a CPU pool of ``slots`` tokens, ``pool_bytes`` over all
    ranks, fits in ``available`` bytes (default: this machine's now). The pool is committed as
    it fills, so a pool too big would start and fail later, when its cache grows."""
    available = available_memory_bytes() if available is None else available
    if pool_bytes > available:
        raise KVMemoryError(
            f"a KV pool of {slots} tokens needs {_gb(pool_bytes)}; this machine has "
            f"{_gb(available)} available (lower max_total_tokens or mem_fraction_static)"
        )


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"
