"""KV pinned for compiled DSL programs between their steps (``runtime/program``).

A compiled program runs as a chain of requests. When one finishes, the KV of its prompt and
output goes into the radix tree as for any request, and is also pinned here under the program's
branch: a lock on the deepest node, kept until the program joins the branch or ends. The next
step of that branch is admitted from the pinned node (``RadixCache.match_from``): no match of
its prompt from the root, and nothing it continues can be evicted in between, even while the
program waits on a Python callback. Fork branches continue from their parent's pin, so they
share the parent's slots directly.

Pins are released by ``ProgramRelease``, when a program has not used them for ``ttl_s``
seconds (a client that vanished without ending its program), and by the scheduler when the KV
they hold is what keeps every waiting request from starting (least recently used program
first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radix_cache import RadixCache, TreeNode


@dataclass
class Pin:
    """``node`` (locked) is ``length`` tokens deep: the branch's tokens up to there have KV."""

    node: TreeNode
    length: int


@dataclass
class _Program:
    pins: dict[str, Pin] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)


class ProgramPins:
    def __init__(self, tree: RadixCache | None, ttl_s: float) -> None:
        self.tree = tree
        self.ttl_s = ttl_s
        self._programs: dict[str, _Program] = {}
        self._next_expiry_check = 0.0

    def get(self, program: str, branch: str | None) -> Pin | None:
        entry = self._programs.get(program)
        if entry is None or branch is None:
            return None
        entry.used = time.monotonic()
        return entry.pins.get(branch)

    def pin(self, program: str, branch: str, node: TreeNode, length: int) -> None:
        """Pin ``node`` for ``branch`` (its previous pin, if any, is released)."""
        assert self.tree is not None
        self.tree.lock(node)
        entry = self._programs.setdefault(program, _Program())
        entry.used = time.monotonic()
        old = entry.pins.get(branch)
        entry.pins[branch] = Pin(node, length)
        if old is not None:
            self.tree.unlock(old.node)

    def all_pins(self) -> list[Pin]:
        """Every branch's pin, of every program."""
        return [pin for entry in self._programs.values() for pin in entry.pins.values()]

    def release(self, program: str, branches: list[str] | None = None) -> int:
        """Unpin ``branches`` of ``program`` (all when None); returns how many were pinned."""
        entry = self._programs.get(program)
        if entry is None or self.tree is None:
            return 0
        names = list(entry.pins) if branches is None else branches
        released = 0
        for name in names:
            pin = entry.pins.pop(name, None)
            if pin is not None:
                self.tree.unlock(pin.node)
                released += 1
        if branches is None or not entry.pins:
            del self._programs[program]
        return released

    def expire(self, now: float | None = None) -> list[str]:
        """Release the programs idle for longer than ``ttl_s`` (checked at most once a second);
        returns their names."""
        now = time.monotonic() if now is None else now
        if now < self._next_expiry_check:
            return []
        self._next_expiry_check = now + 1.0
        stale = [name for name, p in self._programs.items() if now - p.used > self.ttl_s]
        for name in stale:
            self.release(name)
        return stale

    def shed_lru(self) -> str | None:
        """Release every pin of the least recently used program (None: no pins). Pins only
        save work: a program whose pins are gone continues by matching its prompt from the
        root, so the scheduler sheds them when pinned KV is what keeps anything from
        running."""
        if not self._programs:
            return None
        name = min(self._programs, key=lambda n: self._programs[n].used)
        self.release(name)
        return name

    def clear(self) -> None:
        for name in list(self._programs):
            self.release(name)

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    @property
    def num_pins(self) -> int:
        return sum(len(p.pins) for p in self._programs.values())
