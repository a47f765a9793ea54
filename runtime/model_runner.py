"""Owns the model and its KV memory, and runs one packed forward at a time."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import arbor_kernels as kernels
import torch

from runtime import kv_budget
from runtime.cascade import DEFAULT_MIN_PREFIX
from runtime.cuda_graph_runner import (
    DECODE_OPS,
    CudaGraphFactory,
    CudaGraphRunner,
    GraphFactory,
)
from runtime.distributed.group import SINGLE, TPGroup
from runtime.distributed.partition import HeadPartition, check_tp_size
from runtime.forward_batch import ForwardBatch
from runtime.layers.quantized import resident_weight_bytes
from runtime.memory_pool import KVPool, ReqToTokenPool, resolve_kv_cache_dtype
from runtime.model_config import ModelConfig, resolve_dtype
from runtime.model_files import locate_model
from runtime.model_loader import load_model, resolve_quantization
from runtime.server_args import DEFAULT_CUDA_GRAPH_MAX_BS, ServerArgs
from runtime.startup_phases import StartupPhases

logger = logging.getLogger(__name__)

# Test-only: CPU tests set this to an eager stand-in for CUDA graphs, so that the graph path
# (static buffers, padding, fallbacks) runs on a machine without a GPU. Never set elsewhere.
_TEST_GRAPH_FACTORY: GraphFactory | None = None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread inside: loading is hundreds of small copies, and each parallel
    region costs more than it saves, most when a server's other processes start on the same
    cores (SmolLM2-135M on 2 busy cores: 6.9 s to load and pack with 2 threads, 2.6 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class RunnerConfig:
    """What a model runner is built from: the slice of ``ServerArgs`` it reads.

    kv_slots: KV pool size in tokens; None derives it from ``mem_fraction`` of the device's
    memory left after the weights, in whole pages of ``page_size``; with ``mem_fraction`` None
    too, on CPU from the requests the pool can serve (``kv_budget.default_cpu_kv_slots``:
    ``max_requests * context_len``, capped at 1 GiB of K/V), on GPU from
    ``kv_budget.DEFAULT_GPU_MEM_FRACTION``. A CPU pool bigger than the memory available is a
    ``kv_budget.KVMemoryError``. max_requests: rows of the request-to-slot table.
    context_len: None takes the model's. kv_cache_dtype: ``auto`` stores K/V in the compute
    dtype, ``fp32``, ``bf16`` or ``fp16`` in that dtype (and sizes the default pool by it).
    cascade_min_prefix: decode requests sharing at least this many tokens
    attend to them in one shared-prefix pass (runtime/cascade.py); None turns that off.
    pack_weights: move the projection weights into oneDNN's layout on CPU, float32 or bfloat16
    (``CausalLM.pack_weights``). deterministic: the kernels sum in one fixed order, whatever the
    batch, chunking or cache (``kernels.set_deterministic``; CPU, one rank); it turns off
    cascade attention and weight packing, whose orders depend on the batch.
    cuda_graph_max_bs, disable_cuda_graph: on CUDA, decode batches of up to
    ``cuda_graph_max_bs`` requests (None: min(max_requests, 160)) replay graphs captured at
    start-up (runtime/cuda_graph_runner.py), unless ``disable_cuda_graph``; other
    devices never capture. kernel_backend: the kernels' backend for this process
    (``kernels.set_kernel_backend``; None leaves it as it is). quantization: how quantized
    weights run (``model_loader.QUANTIZATIONS``): ``gguf`` keeps a GGUF file's blocks and runs
    them in the quantized kernels (CPU, one rank); ``none`` dequantizes them to ``dtype`` at
    load; ``auto`` is ``gguf`` for a GGUF file on CPU on one rank, else ``none``
    (``model_loader.resolve_quantization``). window_kv_ratio: for a model with sliding-window
    layers, give those layers a pool of this fraction of the full pool's slots, holding only
    each sequence's window (radix_cache/swa.py; the scheduler's ``HybridSlotAllocator`` runs
    it); None keeps every layer's KV by full slots, with ``window_kv_off`` saying why (logged).
    """

    model_path: str
    dtype: str = "auto"
    device: str = "cpu"
    kv_slots: int | None = None
    max_requests: int = 256
    context_len: int | None = None
    mem_fraction: float | None = None
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    cascade_min_prefix: int | None = DEFAULT_MIN_PREFIX
    pack_weights: bool = True
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    kernel_backend: str | None = None
    quantization: str = "auto"
    window_kv_ratio: float | None = None
    window_kv_off: str = "not asked for"
    deterministic: bool = False

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> RunnerConfig:
        """The target model's runner as ``args`` (device defaults filled in) ask for it. The
        pool holds ``max_total_tokens`` in whole pages plus the padding page."""
        pages = (
            None if args.max_total_tokens is None else -(-args.max_total_tokens // args.page_size)
        )
        off = _window_kv_off(args)
        return cls(
            args.model_path,
            dtype=args.dtype,
            device=args.device,
            kv_slots=None if pages is None else (pages + 1) * args.page_size,
            max_requests=args.max_running_requests,
            context_len=args.context_length,
            mem_fraction=args.mem_fraction_static,
            page_size=args.page_size,
            kv_cache_dtype=args.kv_cache_dtype,
            cascade_min_prefix=None if args.disable_cascade_attention else DEFAULT_MIN_PREFIX,
            pack_weights=not args.disable_weight_packing,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            kernel_backend=args.kernel_backend,
            quantization=args.quantization,
            window_kv_ratio=None if off else args.swa_full_tokens_ratio,
            window_kv_off=off or "",
            deterministic=args.deterministic,
        )


class ModelRunner:
    """Loads ``config.model_path`` on ``config.device`` and sizes the KV pool (``RunnerConfig``
    says how). Padded CUDA-graph rows write slot 0 (``PADDING_SLOT``): callers placing KV
    themselves must leave it free, as the KV allocator does. tp: the tensor-parallel group this
    runner is one rank of (its model holds that rank's shards, its KV pool that rank's KV heads;
    every rank must build its runner and run each forward together, see runtime/distributed/);
    the default ``SINGLE`` runs the whole model.
    """

    def __init__(self, spec: RunnerConfig, tp: TPGroup = SINGLE) -> None:
        # How long each part of this constructor took (the server logs it at startup).
        self.startup_phases = phases = StartupPhases()
        if spec.kernel_backend is not None:  # before loading: the model and graphs use them
            kernels.set_kernel_backend(spec.kernel_backend)
        if spec.deterministic and (torch.device(spec.device).type != "cpu" or tp.size > 1):
            raise ValueError("--deterministic runs on CPU on one rank only (no --tp-size)")
        kernels.set_deterministic(spec.deterministic)
        if torch.device(spec.device).type == "cpu" and kernels.kernel_backend() != "torch":
            kernels.native_available()  # loaded now, not inside the first op that runs
        cpu = torch.device("cpu")
        if spec.deterministic and not kernels.runs_natively("extend_attention", cpu):
            raise ValueError(
                "--deterministic needs the native CPU kernels (build them: make install; "
                "not --kernel-backend torch)"
            )
        phases.lap("kernels")
        self.config = config = ModelConfig.from_pretrained(spec.model_path)
        check_tp_size(tp.size, config.num_heads, config.num_kv_heads, config.intermediate_size)
        self.tp = tp
        self.heads = HeadPartition.of_rank(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
        self.cascade_min_prefix = None if spec.deterministic else spec.cascade_min_prefix
        self.device = torch.device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(spec.kv_cache_dtype, self.dtype)
        torch.set_grad_enabled(False)
        gguf_file = locate_model(spec.model_path).gguf is not None
        self.quantization = resolve_quantization(
            spec.quantization, gguf_file, self.device.type, tp.size
        )
        with one_thread():
            self.model = load_model(self.config, self.dtype, self.device, tp, self.quantization)
        phases.lap("load model")
        self.context_len = spec.context_len or self.config.max_position_embeddings
        self.max_requests = spec.max_requests
        self.page_size = spec.page_size
        windows = [self.config.window(layer) for layer in range(self.config.num_layers)]
        # The widest window, when the window layers keep their KV in a pool of their own.
        self.window = max(windows) if spec.window_kv_ratio is not None and tp.size == 1 else 0
        self.window_kv_ratio = spec.window_kv_ratio or 0.0
        if any(windows) and not self.window:
            reason = spec.window_kv_off if tp.size == 1 else "tensor parallelism"
            logger.info("window KV memory off (%s): window layers keep every token", reason)
        self.kv_slots = spec.kv_slots or self._default_kv_slots(spec.mem_fraction)
        self.window_slots = self._window_slots() if self.window else 0
        if self.device.type == "cpu":
            pool_bytes = self.kv_slots * self.kv_bytes_per_token * tp.size
            kv_budget.check_pool_fits(self.kv_slots, pool_bytes)
        self.kv_pool = KVPool(
            self.kv_slots,
            self.config.num_layers,
            self.heads.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
            frozenset(layer for layer, w in enumerate(windows) if w and self.window),
            self.window_slots,
        )
        # A tensor-parallel leader's writes to the table are replayed on its workers' tables.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_requests,
            self.context_len,
            self.device,
            record_writes=tp.size > 1 and tp.is_leader,
        )
        phases.lap("cache pool")
        if spec.pack_weights and not spec.deterministic:  # after sizing the KV pool
            with one_thread():
                self.model.pack_weights()
            phases.lap("pack weights")
        self.graph_runner: CudaGraphRunner | None = None
        factory = None if spec.disable_cuda_graph else self._graph_factory()
        if factory is not None and self.window:
            # The window slots are per batch tensors no graph captures (not built yet).
            logger.warning("CUDA graphs are off with window KV memory")
            factory = None
        if factory is not None and tp.size > 1:
            # Capturing collectives in CUDA graphs has not been run here (no multi-GPU machine).
            logger.warning("CUDA graphs are off under tensor parallelism")
            factory = None
        if factory is not None:
            wanted = spec.cuda_graph_max_bs
            wanted = DEFAULT_CUDA_GRAPH_MAX_BS if wanted is None else wanted
            max_bs = min(wanted, self.max_requests)  # no decode batch holds more requests
            with torch.inference_mode():
                self.graph_runner = CudaGraphRunner(
                    self.model, self.kv_pool, self.req_to_token_pool, self.config.vocab_size,
                    max_bs, factory,
                )  # fmt: skip
            phases.lap("cuda graphs")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per full slot in this rank's pool: every layer's, or with window KV
        memory the full layers' plus the window layers' times ``window_kv_ratio`` (their pool
        holds that fraction of the slots)."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_layer = 2 * self.heads.num_kv_heads * self.config.head_dim * elem
        layers = float(self.config.num_layers)
        if self.window:
            windowed = sum(1 for w in self.config.layer_windows if w)
            layers -= windowed * (1.0 - self.window_kv_ratio)
        return int(per_layer * layers)

    def _window_slots(self) -> int:
        """The window pool's slots: ``window_kv_ratio`` of the full pool's, and at least what
        one request needs to go on: a full window and a chunk of 64 tokens or two pages (and
        the padding page). A pool that small prefills in chunks that small."""
        page = self.page_size
        least = self.window + max(64, 2 * page) + page
        slots = max(int(self.kv_slots * self.window_kv_ratio), least)
        return -(-slots // page) * page

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the tensor-parallel ranks this runner started (none here)."""
        return []

    def shutdown(self) -> None:
        """Stop what the runner started (nothing here; a tensor-parallel leader's workers)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the packed batch; returns logits [N, vocab] float32 for ``batch.logit_indices``."""
        with torch.inference_mode():
            if self.graph_runner is not None and self.graph_runner.can_run(batch):
                return self.graph_runner.replay(batch)
            return self.model(batch)

    def build_batch(
        self,
        rows: list[int],
        prefix_lens: list[int],
        new_token_ids: list[list[int]],
        logits: str | torch.Tensor = "last",
    ) -> ForwardBatch:
        return ForwardBatch.build(
            rows, prefix_lens, new_token_ids, self.kv_pool, self.req_to_token_pool, logits,
            self.cascade_min_prefix if self.device.type == "cpu" else None,
        )  # fmt: skip

    def _graph_factory(self) -> GraphFactory | None:
        """How to capture decode graphs here, or None to run every batch eagerly."""
        if _TEST_GRAPH_FACTORY is not None:
            return _TEST_GRAPH_FACTORY
        if self.device.type != "cuda":
            return None
        unsafe = [op for op in DECODE_OPS if not kernels.graph_safe(op, self.device)]
        if unsafe:
            logger.warning(
                "CUDA graphs off: kernel backend %r has no graph-safe %s (use the triton "
                "kernels, --kernel-backend auto or triton)",
                kernels.kernel_backend(), ", ".join(unsafe),
            )  # fmt: skip
            return None
        return CudaGraphFactory()

    def _default_kv_slots(self, mem_fraction: float | None) -> int:
        if mem_fraction is None and self.device.type == "cpu":
            slots = kv_budget.default_cpu_kv_slots(
                self.max_requests, self.context_len, self.kv_bytes_per_token, self.page_size,
                self.tp.size,
            )  # fmt: skip
            return self.tp.min(slots)
        if mem_fraction is None:
            mem_fraction = kv_budget.DEFAULT_GPU_MEM_FRACTION
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * mem_fraction
        else:
            # Every rank of a CPU tensor-parallel group shares this machine's memory.
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / self.tp.size
            weights = resident_weight_bytes(self.model)
            budget = total * mem_fraction - weights
        # Slot indices are shared by the ranks: each pool gets the smallest rank's count.
        slots = self.tp.min(int(budget // self.kv_bytes_per_token))
        if slots < 1024:
            raise MemoryError(
                f"only {slots} KV slots fit in {mem_fraction:.0%} of device memory; "
                "pass a larger mem_fraction or an explicit kv_slots"
            )
        # More slots than every request row could fill would never be used.
        slots = min(slots, self.context_len * self.max_requests)
        return slots - slots % self.page_size


def _window_kv_off(args: ServerArgs) -> str:
    """Why ``args`` keep window layers' KV by full slots ("": they need not)."""
    if args.disable_hybrid_swa_memory:
        return "--disable-hybrid-swa-memory"
    if args.kv_disk_path is not None:
        return "the disk tier (--kv-disk-path) saves every layer's KV of each token"
    if args.speculative_algorithm is not None:
        return "speculative decoding"
    return ""
