"""Prefill admission: which waiting requests start (or continue) prefilling this step.

Budgets: ``max_prefill_tokens`` new tokens per step, ``chunked_prefill_size`` per request per
step, ``max_running_requests``, and KV: a request is admitted only if its prompt plus its
reserved decode room fits in free + evictable slots after the room reserved for every running
decode. A request sharing uncached prefix with one admitted this step reads that request's
slots for it (computed once, in this step's forward: ``KVCacheManager.lend``); it waits a round
instead when a long part of what they share is computed only in the other's later chunks.
"""

from __future__ import annotations

import numpy as np

from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req
from runtime.scheduler.token_ratio import NewTokenRatio
from runtime.server_args import ServerArgs

__all__ = ["IN_BATCH_SHARING_THRESHOLD", "PrefillAdmission"]

# A request sharing uncached tokens with one admitted in the same step reads that one's slots
# for them (KVCacheManager.lend); it is held back a round instead when at least this many of
# the shared tokens are computed only in the other's later prefill chunks.
IN_BATCH_SHARING_THRESHOLD = 32


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
                n = self.kv.chunk_limit(min(req.pending_len, budget, self.chunk_size))
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
            kv_budget -= req.kv.disk_tokens  # loaded into slots the budget counted as free
            if not self._share_in_step(req, admitted, admitted_ids):
                self.kv.release(req, keep_in_cache=False)
                continue
            need = req.pending_len + self.ratio.reserve(req)
            if need > kv_budget and (running or admitted):
                self.kv.release(req, keep_in_cache=False)
                break
            n = self.kv.chunk_limit(min(req.pending_len, budget, self.chunk_size))
            if not self.kv.alloc_extend(req, n):
                self.kv.release(req, keep_in_cache=False)
                break
            chunks.append((req, n))
            admitted.append(req)
            admitted_ids.append(req.token_ids.array())
            kv_budget -= need
            budget -= n
        return chunks, admitted

    def _share_in_step(self, req: Req, admitted: list[Req], admitted_ids: list[np.ndarray]) -> bool:
        """Borrow, for ``req`` (admitted, nothing allocated yet), the slots of the request
        admitted this step with the same cache salt that computes the most of its uncached
        prefix. False: hold ``req`` back a round, because at least IN_BATCH_SHARING_THRESHOLD
        more shared tokens are computed only in later chunks. Without a tree nothing outlives
        its request, so nothing is lent (or worth waiting for)."""
        if not admitted or self.kv.tree is None:
            return True
        ids = req.token_ids.array()
        page = self.kv.page_size
        limit = req.match_limit  # positions whose logits it needs are its own to compute
        best, lender, reachable = req.kv.cached_len, None, req.kv.cached_len
        first = req.kv.cached_len  # the first uncached position: a sharer must agree there
        if first >= limit:
            return True
        token = ids[first]
        for other, other_ids in zip(admitted, admitted_ids, strict=True):
            if other.cache_salt != req.cache_salt:  # tenants share no KV, computed or cached
                continue
            if len(other_ids) <= first or other_ids[first] != token:
                continue
            n = min(len(ids), len(other_ids))
            differ = np.flatnonzero(ids[:n] != other_ids[:n])
            shared = min(int(differ[0]) if differ.size else n, limit)
            reachable = max(reachable, shared)
            end = min(shared, other.kv.kv_len)
            end -= end % page
            if end > best:
                best, lender = end, other
        if reachable - best >= IN_BATCH_SHARING_THRESHOLD:
            return False
        if lender is not None:
            self.kv.lend(lender, req, best)
        return True
