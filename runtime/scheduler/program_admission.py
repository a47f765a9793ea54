"""The scheduler's one hook for compiled DSL programs (``runtime/program``) in admission.

A program runs as a chain of requests whose KV stays pinned between steps
(``program_pins.py``). Admission treats them apart in three ways, all here: the requests of
one fork are admitted together and, when KV is short, requests continuing a pinned program go
first (``order``); pins unused for their time-to-live are dropped (``on_step``); and a pinned
program yields its KV, least recently used first, when that KV is what keeps waiting requests
out (``make_room``). ``--disable-program-scheduling`` turns the ordering off; pins stay.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from runtime.scheduler.kv_manager import KVCacheManager
from runtime.scheduler.req import Req
from runtime.scheduler.token_ratio import NewTokenRatio

logger = logging.getLogger(__name__)


class ProgramAdmission:
    def __init__(self, kv: KVCacheManager, ratio: NewTokenRatio, ordering: bool) -> None:
        self.kv, self.ratio, self.ordering = kv, ratio, ordering
        self.pins_shed = 0  # programs unpinned because their KV blocked admission

    def on_step(self) -> None:
        for program in self.kv.pins.expire():
            logger.warning("program %s was idle too long: its pinned KV is released", program)

    def order(self, ordered: list[Req]) -> list[Req]:
        """A policy's order, program-aware unless disabled (``_program_order``)."""
        return _program_order(ordered, self.kv) if self.ordering else ordered

    def make_room(self, waiting: list[Req], running: list[Req], stuck: bool = False) -> bool:
        """Unpin the least recently used program when pinned KV keeps ``waiting`` out: when
        even its smallest request does not fit in the KV left (free and evictable, after the
        running decodes' reserve), or, ``stuck``, when nothing runs and nothing was admitted.
        Pinned KV only saves recomputing a program's prefix, so it yields to requests that
        cannot start without it (the program's next step then matches from the root)."""
        if not waiting or not self.kv.pins.num_programs:
            return False
        if not stuck:
            room = self.kv.available_tokens() - sum(self.ratio.reserve(r) for r in running)
            if room >= min(r.pending_len for r in waiting):
                return False
        elif running:
            return False
        if self.kv.pins.shed_lru() is None:
            return False
        self.pins_shed += 1
        return True


def _program_order(ordered: list[Req], kv: KVCacheManager) -> list[Req]:
    """Program-aware order (compiled DSL programs, ``runtime/program``), applied to a policy's
    order: the requests of one fork (``ProgramStep.group``) move up to their first member, so
    the branches are admitted together; and when the queue's prompts need more KV than is free
    or evictable, requests continuing a program that holds pinned KV go first (finishing
    running programs before starting new ones). Otherwise the order is the policy's."""
    if not any(r.program is not None for r in ordered):
        return ordered
    groups: dict[str, list[Req]] = defaultdict(list)
    for req in ordered:
        if req.program is not None and req.program.group is not None:
            groups[req.program.group].append(req)
    result: list[Req] = []
    placed: set[int] = set()
    for req in ordered:
        if id(req) in placed:
            continue
        group = req.program.group if req.program is not None else None
        members = groups[group] if group is not None else [req]
        result.extend(members)
        placed.update(id(m) for m in members)
    if sum(r.pending_len for r in result) > kv.available_tokens():
        continuing = [r for r in result if _continues_program(r, kv)]
        if continuing:
            chosen = {id(r) for r in continuing}
            result = continuing + [r for r in result if id(r) not in chosen]
    return result


def _continues_program(req: Req, kv: KVCacheManager) -> bool:
    step = req.program
    return step is not None and kv.pins.get(step.program, step.continue_from) is not None
