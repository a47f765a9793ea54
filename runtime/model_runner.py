"""Owns the model and its KV memory, and runs one packed forward at a time."""

from __future__ import annotations

import os

import torch

from runtime.cascade import DEFAULT_MIN_PREFIX
from runtime.forward_batch import ForwardBatch
from runtime.memory_pool import KVPool, ReqToTokenPool, resolve_kv_cache_dtype
from runtime.model_config import ModelConfig, resolve_dtype
from runtime.model_loader import load_model


class ModelRunner:
    """Loads ``model_path`` on ``device`` and sizes the KV pool.

    kv_slots: KV pool size in tokens; None derives it from ``mem_fraction`` of the device's
    memory left after the weights, in whole pages of ``page_size``. max_requests: rows of the
    request-to-slot table. kv_cache_dtype: ``auto`` stores K/V in the compute dtype, ``fp32``,
    ``bf16`` or ``fp16`` in that dtype (and sizes the default pool by it).
    cascade_min_prefix: decode requests sharing at least this many tokens attend to them in
    one shared-prefix pass (runtime/cascade.py); None turns that off. pack_weights: move the
    projection weights into oneDNN's layout on CPU float32 (``CausalLM.pack_weights``).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        device: str = "cpu",
        kv_slots: int | None = None,
        max_requests: int = 256,
        context_len: int | None = None,
        mem_fraction: float = 0.3,
        page_size: int = 1,
        kv_cache_dtype: str = "auto",
        cascade_min_prefix: int | None = DEFAULT_MIN_PREFIX,
        pack_weights: bool = True,
    ) -> None:
        self.config = ModelConfig.from_pretrained(model_path)
        self.cascade_min_prefix = cascade_min_prefix
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        torch.set_grad_enabled(False)
        self.model = load_model(self.config, self.dtype, self.device)
        self.context_len = context_len or self.config.max_position_embeddings
        self.max_requests = max_requests
        self.page_size = page_size
        self.kv_slots = kv_slots or self._default_kv_slots(mem_fraction)
        self.kv_pool = KVPool(
            self.kv_slots,
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.req_to_token_pool = ReqToTokenPool(max_requests, self.context_len, self.device)
        if pack_weights:  # after sizing the KV pool, which counts the plain weights
            self.model.pack_weights()

    @property
    def kv_bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * elem

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the packed batch; returns logits [N, vocab] float32 for ``batch.logit_indices``."""
        with torch.inference_mode():
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

    def _default_kv_slots(self, mem_fraction: float) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * mem_fraction
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = total * mem_fraction - weights
        slots = int(budget // self.kv_bytes_per_token)
        if slots < 1024:
            raise MemoryError(
                f"only {slots} KV slots fit in {mem_fraction:.0%} of device memory; "
                "pass a larger mem_fraction or an explicit kv_slots"
            )
        # More slots than every request row could fill would never be used.
        slots = min(slots, self.context_len * self.max_requests)
        return slots - slots % self.page_size
