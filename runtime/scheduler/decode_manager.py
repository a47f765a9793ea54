"""Decode bookkeeping: a KV slot for every running decode each step, retracting under pressure.

When the pool cannot give every decode its slot even after evicting unlocked cache, requests
are retracted, the one with the least computed KV (the least work to redo) first: its KV goes
into the radix tree (so its prefix stays cached while memory allows), its slots and lock are
released, and it rejoins the waiting queue with its output so far. No request is dropped; a
request that cannot progress even alone in the pool finishes with an error instead.

Compiled programs' pinned KV (``program_pins.py``) is unpinned, least recently used program
first, before any request is retracted. Program-aware (the default): steps of compiled DSL
programs are retracted after every other request, so a program that already holds pinned KV
is not pushed back behind new work.
"""

from __future__ import annotations

from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req
from runtime.scheduler.token_ratio import NewTokenRatio


class DecodeManager:
    def __init__(
        self, kv: KVCacheManager, ratio: NewTokenRatio, programs_last: bool = True
    ) -> None:
        self.kv = kv
        self.ratio = ratio
        self.programs_last = programs_last
        self.num_retracted = 0
        self.num_pins_shed = 0

    def _cost(self, req: Req) -> tuple[bool, int]:
        """Sort key: the cheapest to retract first (programs last when program-aware)."""
        return (self.programs_last and req.program is not None, req.kv.kv_len)

    def allocate(self, running: list[Req]) -> tuple[list[Req], list[Req], list[Req]]:
        """Give each decoding request (pending_len == 1) slots for this step: one, plus its
        draft.

        Returns (decodes ready to run, requests retracted back to the queue, requests failed
        for lack of memory). Partially prefilled requests may be retracted too.
        """
        # Most computed KV first: under pressure, the cheapest to redo are last in line.
        queue = sorted((r for r in running if r.pending_len == 1), key=self._cost, reverse=True)
        victims = sorted((r for r in running if r.pending_len > 1), key=self._cost)
        ready: list[Req] = []
        retracted: list[Req] = []
        failed: list[Req] = []
        while queue:
            req = queue[0]
            if self.kv.alloc_extend(req, req.step_len):
                ready.append(queue.pop(0))
                continue
            if req.draft.tokens:  # under pressure, drop the draft before retracting anyone
                req.draft.clear()
                continue
            if self.kv.pins.shed_lru() is not None:  # then programs' pins, before requests
                self.num_pins_shed += 1
                continue
            # Out of memory: retract the cheapest request not yet served this step.
            victim = victims.pop(0) if victims else queue.pop()
            if victim is req and not ready and not victims and len(queue) == 0:
                victim.fail(
                    400,
                    f"request needs more KV than the pool holds ({self.kv.capacity} tokens); "
                    "raise max_total_tokens or shorten the request",
                )
                self.kv.release(victim, keep_in_cache=False)
                failed.append(victim)
                continue
            self.kv.retract(victim)
            victim.retract()
            retracted.append(victim)
        if retracted:
            self.num_retracted += len(retracted)
            self.ratio.on_retract()
        return ready, retracted, failed

    def retract_cheapest(self, running: list[Req]) -> Req:
        """Retract the running request with the least computed KV; return it."""
        victim = min(running, key=self._cost)
        self.kv.retract(victim)
        victim.retract()
        self.num_retracted += 1
        self.ratio.on_retract()
        return victim
