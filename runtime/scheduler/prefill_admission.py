"""Prefill admission: which waiting requests start (or continue) prefilling this step.

Budgets: ``max_prefill_tokens`` new tokens per step, ``chunked_prefill_size`` per request per
step, ``max_running_requests``, and KV: a request is admitted only if its prompt plus its
reserved decode room fits in free + evictable slots after the room reserved for every running
decode. Requests sharing a long uncached prefix with one admitted this step wait one round, so
the first fills the cache and the rest reuse it.
"""

from __future__ import annotations

import numpy as np

from runtime.ipc import IN_BATCH_SHARING_THRESHOLD
from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req
from runtime.scheduler.token_ratio import NewTokenRatio
from runtime.server_args import ServerArgs

__all__ = ["IN_BATCH_SHARING_THRESHOLD", "PrefillAdmission"]


class PrefillAdmission:
    def __init__(
        self, args: ServerArgs, device_type: str, kv: KVCacheManager, ratio: NewTokenRatio
    ) -> None:
        self.kv = kv
        self.ratio = ratio
        self.max_running = args.max_running_requests
        self.max_prefill_tokens, chunk = args.prefill_budgets(device_type)
        self.chunk_size = chunk if chunk > 0 else 1 << 62

    def schedule(
        self, running: list[Req], ordered_waiting: list[Req]
    ) -> tuple[list[tuple[Req, int]], list[Req]]:
        """Plan this step's prefill work.

        running: admitted requests (their decode slots for this step already allocated).
        Returns ([(req, n_tokens)] prefill chunks, requests newly admitted from the queue).
        Partially prefilled running requests continue first; admitted requests hold their
        chunk's slots when this returns.
        """
        budget = self.max_prefill_tokens
        chunks: list[tuple[Req, int]] = []
        for req in running:
            if req.pending_len > 1 and budget > 0:
                n = min(req.pending_len, budget, self.chunk_size)
                if not self.kv.alloc_extend(req, n):
                    break
                chunks.append((req, n))
                budget -= n
        kv_budget = self.kv.available_tokens() - sum(self.ratio.reserve(r) for r in running)
        admitted: list[Req] = []
        admitted_ids: list[np.ndarray] = []
        for req in ordered_waiting:
            if budget <= 0 or len(running) + len(admitted) >= self.max_running:
                break
            if not self.kv.admit(req):
                break
            if self._shares_uncached_prefix(req, admitted_ids):
                self.kv.release(req, keep_in_cache=False)
                continue
            need = req.pending_len + self.ratio.reserve(req)
            if need > kv_budget and (running or admitted):
                self.kv.release(req, keep_in_cache=False)
                break
            n = min(req.pending_len, budget, self.chunk_size)
            if not self.kv.alloc_extend(req, n):
                self.kv.release(req, keep_in_cache=False)
                break
            chunks.append((req, n))
            admitted.append(req)
            admitted_ids.append(req.token_ids.array())
            kv_budget -= need
            budget -= n
        return chunks, admitted

    @staticmethod
    def _shares_uncached_prefix(req: Req, admitted_ids: list[np.ndarray]) -> bool:
        ids = req.token_ids.array()
        for other in admitted_ids:
            n = min(len(ids), len(other))
            differ = np.flatnonzero(ids[:n] != other[:n])
            shared = int(differ[0]) if differ.size else n
            if shared - req.cached_len >= IN_BATCH_SHARING_THRESHOLD:
                return True
        return False
