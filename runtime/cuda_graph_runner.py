"""CUDA graphs for decode: capture the decode forward once per batch-size bucket, replay it.

A small model's decode step on a GPU is dominated by kernel launches (a few hundred per step).
At start-up ``CudaGraphRunner`` captures the forward of a DECODE batch (every request adds one
token, one logits row per request) at each bucket of ``capture_batch_sizes``; a later decode
batch of B requests is copied into the static input buffers, padded to the smallest bucket
>= B, replayed as one graph launch, and the first B logits rows are returned.

What a captured graph requires of the forward (``graph_safe`` in ``kernels.dispatch``):

- It reads only the static buffers here, the model's weights, the KV pool and the
  request-to-slot table: fixed addresses, new values on each replay. The batch's host lists
  (``seq_lens_cpu``...) keep their capture-time values, so nothing in the forward may read them.
- No host sync and no Python decision on a tensor's value: every kernel's grid comes from
  shapes only. The triton decode kernels qualify (split lengths and loop bounds come from
  ``seq_lens`` on the device; the split count from B); the torch reference decode attention
  does not (it loops over ``seq_lens.tolist()``), so ``ModelRunner`` captures only when every
  op in ``DECODE_OPS`` resolves to a graph-safe implementation.
- Padding rows are harmless: they write their K/V at ``PADDING_SLOT`` (page 0, which the KV
  allocator never hands out) and attend over one token of ``ReqToTokenPool.padding_row``
  (all zeros, so that same slot). Their logits rows are computed and dropped.

Everything else runs eagerly: EXTEND and MIXED batches, more requests than the largest bucket,
a cascade plan (shared-prefix attention has data-dependent groups), and logits rows that are
not one per request (prompt logprobs, drafts), as well as batches on other pools.

Capture goes through a ``GraphFactory``: on CUDA ``CudaGraphFactory`` (``torch.cuda.CUDAGraph``
sharing one memory pool across buckets, captured largest first so smaller ones reuse its
memory); CPU tests pass an eager stand-in whose replay re-runs the captured callable, which
exercises the static buffers, padding and fallbacks without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch

from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.memory_pool import PADDING_SLOT, KVPool, ReqToTokenPool

# The kernel ops a decode forward calls; capture needs each to be graph-safe on the device.
DECODE_OPS = ("decode_attention", "rms_norm", "fused_add_rms_norm", "apply_rotary_emb",
              "silu_and_mul")  # fmt: skip


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, 16, 24, 32, then every 16 up to ``max_bs``, and
    ``max_bs`` itself. Padding costs at most 15 rows past 32 (under half a bucket below)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_bs + 1, 16)]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CapturedGraph(Protocol):
    def replay(self) -> None:
        """Run the captured work again on the current contents of its buffers."""


# Captures ``run`` (which reads and writes only fixed buffers) and returns it replayable.
GraphFactory = Callable[[Callable[[], None]], CapturedGraph]


class CudaGraphFactory:
    """Captures with ``torch.cuda.CUDAGraph``; every graph shares one memory pool, so capture
    the largest batch first and the others reuse its intermediate buffers. Each callable runs
    ``warmups`` times on a side stream first, so triton compiles and cuBLAS picks its kernels
    before capture (neither may happen while capturing)."""

    def __init__(self, warmups: int = 2) -> None:
        self.warmups = warmups
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], None]) -> CapturedGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmups):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph


class CudaGraphRunner:
    """Captured decode forwards of ``forward`` (a model: ForwardBatch -> logits [N, vocab]
    float32) at each of ``capture_batch_sizes(max_bs)``, over ``kv_pool`` and
    ``req_to_token_pool``. Capture happens here, in the constructor; call it under
    ``torch.inference_mode()`` as the forward will be."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        vocab_size: int,
        max_bs: int,
        graph_factory: GraphFactory,
    ) -> None:
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        device = req_to_token_pool.req_to_token.device
        self.padding_row = req_to_token_pool.padding_row

        def static(fill: int) -> torch.Tensor:  # [max_bs] int64, filled as a padding row
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=device)

        self.input_ids = static(0)
        self.positions = static(0)
        self.out_cache_loc = static(PADDING_SLOT)
        self.req_pool_indices = static(self.padding_row)
        self.seq_lens = static(1)
        self.extend_lens = static(1)
        self.logit_indices = torch.arange(self.max_bs, device=device)
        # One logits buffer for every bucket (each graph copies into its first rows), so the
        # graphs' own logits tensors are temporaries the shared memory pool reuses.
        self.logits = torch.zeros(self.max_bs, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, CapturedGraph] = {}
        for bs in reversed(self.batch_sizes):
            self.graphs[bs] = graph_factory(self._capturable(forward, self._static_batch(bs)))

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` fits a captured graph; decided from host-side fields only."""
        return (
            batch.mode is ForwardMode.DECODE
            and batch.batch_size <= self.max_bs
            and batch.cascade is None
            and batch.logits_last_per_request
            and batch.kv_pool is self.kv_pool
            and batch.req_to_token_pool is self.req_to_token_pool
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of a batch ``can_run`` accepted, as ``forward`` would give;
        a fresh tensor, not a view of the static buffer the next replay overwrites."""
        real = batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, real)]
        self.input_ids[:real].copy_(batch.input_ids)
        self.positions[:real].copy_(batch.positions)
        self.out_cache_loc[:real].copy_(batch.out_cache_loc)
        self.req_pool_indices[:real].copy_(batch.req_pool_indices)
        self.seq_lens[:real].copy_(batch.seq_lens)
        if bs > real:  # rows a bigger batch filled before must be padding again
            self.input_ids[real:bs].zero_()
            self.positions[real:bs].zero_()
            self.out_cache_loc[real:bs].fill_(PADDING_SLOT)
            self.req_pool_indices[real:bs].fill_(self.padding_row)
            self.seq_lens[real:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[:real].clone()

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A DECODE batch of ``bs`` rows viewing the static buffers; its host lists are
        placeholders (the forward must not read them, see the module docstring)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            logit_indices=self.logit_indices[:bs],
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
            num_extend_reqs=0,
            num_extend_tokens=0,
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token_pool,
            logits_last_per_request=True,
        )

    def _capturable(
        self, forward: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch
    ) -> Callable[[], None]:
        logits = self.logits[: batch.batch_size]

        def run() -> None:
            logits.copy_(forward(batch))

        return run
