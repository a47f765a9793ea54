"""The packed description of one model forward: which tokens, where their KV goes, what to attend.

Requests are packed back to back without padding. Requests adding several tokens (prefill,
chunked prefill, a prefix's extension) run through extend attention; requests adding one token
(decodes) through the faster decode kernel. A MIXED batch holds both: its first
``num_extend_reqs`` requests extend, the rest decode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from radix_cache.swa import window_slots
from runtime.cascade import CascadePlan, plan_cascade
from runtime.memory_pool import KVPool, ReqToTokenPool, to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # every request adds any number of tokens
    DECODE = "decode"  # every request adds exactly one token
    MIXED = "mixed"  # extends first, then one-token requests (a prefill chunk beside decodes)


@dataclass(frozen=True)
class BatchInputs:
    """The arguments ``ForwardBatch.build`` packed a batch from: with the same request-to-slot
    table, another rank packs the same batch from them."""

    rows: list[int]
    prefix_lens: list[int]
    new_token_ids: list[list[int]]
    logits: str | torch.Tensor  # "last", "all" or packed row indices on the CPU


@dataclass(frozen=True)
class WindowSlots:
    """Where the window layers of a pool with window KV memory (``KVPool.window_layers``) find
    the batch's K/V: its new tokens' window slots, and a table of the window slots of every
    position of each request (one row per request, in batch order; positions whose window
    half was dropped point into the padding page, and no window kernel reads them)."""

    out_cache_loc: torch.Tensor  # [T]
    table: torch.Tensor  # [B, max seq_len]
    rows: torch.Tensor  # [B]: arange(B)


@dataclass
class ForwardBatch:
    """Tensors on the model's device; ``*_cpu`` lists mirror them for host-side bookkeeping."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, the slot each new token's K/V is written to
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, tokens per request after this forward
    extend_lens: torch.Tensor  # [B] int64, new tokens per request
    logit_indices: torch.Tensor  # [N] int64, rows of the packed tokens to compute logits for
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    num_extend_reqs: int  # requests [0, num_extend_reqs) extend; the rest add one token each
    num_extend_tokens: int  # packed rows [0, num_extend_tokens) belong to the extending requests
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    # Decode requests sharing a prefix, attended to once for all of them (runtime/cascade.py).
    cascade: CascadePlan | None = None
    # logit_indices are exactly each request's last new token, in order; known on the host
    # (decided at build) so a CUDA graph can be chosen without reading a device tensor.
    logits_last_per_request: bool = False
    # When every logit row is the last new token of its request (a subset of the requests, in
    # order: a prefill chunk that does not end its prompt has none): those requests' indices,
    # so the last layer can run only those rows (llama.py). None otherwise.
    logit_reqs: torch.Tensor | None = None
    inputs: BatchInputs | None = None  # what ``build`` packed this batch from
    window: WindowSlots | None = None  # with window KV memory (``KVPool.window_layers``)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    @classmethod
    def build(
        cls,
        rows: list[int],
        prefix_lens: list[int],
        new_token_ids: list[list[int]],
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        logits: str | torch.Tensor = "last",
        cascade_min_prefix: int | None = None,
    ) -> ForwardBatch:
        """Pack requests for one forward.

        rows[b]: request b's req_to_token row, already holding the slots of its prefix_lens[b]
        cached tokens and of its new tokens (positions prefix .. prefix + len(new) - 1).
        logits: "last" computes logits for each request's last new token, "all" for every new
        token, or an explicit [N] tensor of packed row indices (give it on the CPU: a device
        tensor is not inspected, so the batch is never taken for one row per request).
        One-token requests must come after every multi-token one; a batch of only one-token
        requests runs as DECODE.
        cascade_min_prefix: plan shared-prefix decode attention for decode requests sharing at
        least this many tokens (None: never).
        """
        device = req_to_token_pool.req_to_token.device
        extend_lens = [len(ids) for ids in new_token_ids]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        if min(extend_lens, default=0) < 1:
            raise ValueError("every request in a forward batch needs at least one new token")
        positions = torch.cat(
            [torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]
        )
        # Built on the host (the table's host copy) and queued to the device in one go each:
        # nothing here waits for the forward in flight.
        table = req_to_token_pool.host
        row_t = torch.tensor(rows, dtype=torch.int64)
        extend_t = torch.tensor(extend_lens, dtype=torch.int64)
        out_cache_loc = table[row_t.repeat_interleave(extend_t), positions]
        ends = extend_t.cumsum(0)
        if isinstance(logits, torch.Tensor):
            logit_indices = logits
        else:
            logit_indices = torch.arange(int(ends[-1])) if logits == "all" else ends - 1
        last_rows = ends - 1
        on_host = logit_indices.device.type == "cpu"
        wanted = logit_indices.to(torch.int64) if on_host else logit_indices
        last_per_request = on_host and torch.equal(wanted, last_rows)
        logit_reqs = None
        if on_host and 0 < len(wanted) < int(ends[-1]):
            found = torch.searchsorted(last_rows, wanted)
            if bool((found < len(last_rows)).all()) and torch.equal(last_rows[found], wanted):
                logit_reqs = to_device(found, device)
        num_extend = sum(1 for n in extend_lens if n > 1)
        if any(n > 1 for n in extend_lens[num_extend:]):
            raise ValueError("one-token requests must come after every multi-token request")
        if num_extend == 0:
            mode = ForwardMode.DECODE
        elif num_extend == len(extend_lens):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        window = None
        if kv_pool.window_page_map is not None:
            page_map, page_size = kv_pool.window_page_map, kv_pool.window_page_size
            rows_table = table[row_t, : max(seq_lens)]
            window = WindowSlots(
                to_device(window_slots(page_map, out_cache_loc, page_size), device),
                to_device(window_slots(page_map, rows_table, page_size), device),
                to_device(torch.arange(len(rows)), device),
            )
        cascade = None
        if cascade_min_prefix is not None and len(rows) - num_extend >= 2:
            cascade = plan_cascade(
                table, rows[num_extend:], seq_lens[num_extend:], cascade_min_prefix
            )
        return cls(
            mode=mode,
            input_ids=to_device(
                torch.tensor([t for ids in new_token_ids for t in ids], dtype=torch.int64), device
            ),
            positions=to_device(positions, device),
            out_cache_loc=to_device(out_cache_loc, device),
            req_pool_indices=to_device(row_t, device),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int64), device),
            extend_lens=to_device(extend_t, device),
            logit_indices=to_device(logit_indices, device),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=extend_lens,
            num_extend_reqs=num_extend,
            num_extend_tokens=sum(extend_lens[:num_extend]),
            kv_pool=kv_pool,
            req_to_token_pool=req_to_token_pool,
            cascade=cascade,
            logits_last_per_request=last_per_request,
            logit_reqs=logit_reqs,
            window=window,
            inputs=BatchInputs(
                rows,
                prefix_lens,
                new_token_ids,
                logits.cpu() if isinstance(logits, torch.Tensor) else logits,
            ),
        )
