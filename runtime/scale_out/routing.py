"""Which replica gets a request: the routing policies of ``arbor serve --dp N``.

- ``round_robin``: the live replicas in turn.
- ``random``: a live replica drawn uniformly (seeded).
- ``shortest_queue``: the live replica with the fewest requests in flight (routed and not
  finished), ties to the lowest index.
- ``cache_aware`` (default): keeps, per replica, an ``ApproxPrefixTree`` of the token ids sent
  there (prompts, then outputs as they finish). A request goes

  1. to the least-loaded replica when the load is out of balance: the busiest live replica
     has more than ``balance_abs`` requests in flight beyond the idlest *and* more than
     ``balance_rel`` times as many;
  2. else to the replica whose tree holds the longest prefix of the prompt, when that prefix
     is worth it: at least ``cache_threshold`` of the prompt's tokens (ties: the less loaded);
  3. else to the least-loaded replica (ties: the one whose tree holds the fewest tokens, so new
     prefixes spread out).

  The chosen replica's tree records the prompt. Sessions of one chat and branches of one DSL
  program (which repeat their history or the program's prefix) therefore land where that
  prefix already sits, as long as the load allows. Prefixes are matched under the request's
  cache salt, as the replicas' caches match them: another tenant's prefix is no cache hit.

Whatever the policy, a request with a ``routing_key`` (OpenAI's ``prompt_cache_key``: the
client's word that its requests share a prefix) goes where the last request with that key and
salt went, while that replica lives and the load is in balance (rule 1); the key's replica is
remembered for the ``max_routing_keys`` most recent keys.

Not thread-safe: the server's event loop calls it.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.scale_out.prefix_tree import ApproxPrefixTree
from runtime.server_args import ROUTING_POLICIES


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs: int = 16
    balance_rel: float = 1.5
    max_tree_tokens: int = 1 << 22
    max_routing_keys: int = 1 << 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTING_POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("need balance_abs >= 0 and balance_rel >= 1")
        if self.max_routing_keys < 1:
            raise ValueError("max_routing_keys must be at least 1")


class Router:
    """Chooses among ``num_replicas`` replicas, of which those marked dead are skipped."""

    def __init__(self, num_replicas: int, config: RouterConfig, alive: bool = True) -> None:
        """``alive``: whether the replicas start out taking requests (a server marks each
        alive when it first answers)."""
        if num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.config = config
        self.num_replicas = num_replicas
        self.trees = [ApproxPrefixTree(config.max_tree_tokens) for _ in range(num_replicas)]
        self.load = [0] * num_replicas
        self.alive = [alive] * num_replicas
        self.routed = [0] * num_replicas
        self.decisions: Counter[str] = Counter()
        self.matched_tokens = 0
        self.prompt_tokens = 0
        # (cache salt, routing key) -> the replica its last request went to, oldest first.
        self.keyed: OrderedDict[tuple[str | None, str], int] = OrderedDict()
        self._next = 0
        self._random = random.Random(config.seed)

    def live(self) -> list[int]:
        return [i for i in range(self.num_replicas) if self.alive[i]]

    def choose(
        self,
        ids: Sequence[int],
        exclude: Sequence[int] = (),
        cache_salt: str | None = None,
        routing_key: str | None = None,
    ) -> int | None:
        """The replica for a prompt of token ids ``ids`` sent with ``cache_salt`` and
        ``routing_key`` (None: no live replica); counts the request into that replica's load
        and records the prompt in its tree."""
        candidates = [i for i in self.live() if i not in exclude]
        if not candidates:
            return None
        policy = self.config.policy
        keyed = self._keyed(candidates, cache_salt, routing_key)
        if keyed is not None:
            chosen, reason = keyed, "routing_key"
        elif policy == "round_robin":
            chosen = self._round_robin(candidates)
            reason = policy
        elif policy == "random":
            chosen, reason = self._random.choice(candidates), policy
        elif policy == "shortest_queue":
            chosen, reason = self._least_loaded(candidates), policy
        else:
            chosen, reason = self._cache_aware(ids, candidates, cache_salt)
        if routing_key is not None:
            self.keyed[(cache_salt, routing_key)] = chosen
            self.keyed.move_to_end((cache_salt, routing_key))
            if len(self.keyed) > self.config.max_routing_keys:
                self.keyed.popitem(last=False)
        self.decisions[reason] += 1
        self.routed[chosen] += 1
        self.load[chosen] += 1
        self.prompt_tokens += len(ids)
        if policy == "cache_aware":
            self.trees[chosen].insert(ids, cache_salt)
        return chosen

    def _keyed(
        self, candidates: list[int], cache_salt: str | None, routing_key: str | None
    ) -> int | None:
        """The replica a routing key holds, while it is a candidate and not overloaded."""
        if routing_key is None:
            return None
        replica = self.keyed.get((cache_salt, routing_key))
        if replica is None or replica not in candidates:
            return None
        load, idlest = self.load[replica], min(self.load[i] for i in candidates)
        if load - idlest > self.config.balance_abs and load > self.config.balance_rel * idlest:
            return None
        return replica

    def assign(
        self, replica: int, ids: Sequence[int], reason: str, cache_salt: str | None = None
    ) -> None:
        """Count a request the caller placed on ``replica`` itself (a compiled program's next
        step goes where its pinned KV is) as ``choose`` counts its own choices."""
        self.decisions[reason] += 1
        self.routed[replica] += 1
        self.load[replica] += 1
        self.prompt_tokens += len(ids)
        if self.config.policy == "cache_aware":
            self.trees[replica].insert(ids, cache_salt)

    def finished(
        self, replica: int, ids: Sequence[int] | None = None, cache_salt: str | None = None
    ) -> None:
        """A request routed to ``replica`` ended; ``ids``: its prompt and output, to record
        under its ``cache_salt``."""
        self.load[replica] = max(0, self.load[replica] - 1)
        if ids is not None and self.config.policy == "cache_aware":
            self.trees[replica].insert(ids, cache_salt)

    def mark_dead(self, replica: int) -> None:
        """The replica is gone: no more requests, and its cache is gone with it."""
        self.alive[replica] = False
        self.load[replica] = 0
        self.trees[replica].clear()
        for key in [key for key, held in self.keyed.items() if held == replica]:
            del self.keyed[key]

    def mark_alive(self, replica: int) -> None:
        self.alive[replica] = True

    def reset_trees(self) -> None:
        """Every replica's cache was flushed."""
        for tree in self.trees:
            tree.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.config.policy,
            "decisions": dict(self.decisions),
            "routed": list(self.routed),
            "in_flight": list(self.load),
            "alive": list(self.alive),
            "tree_tokens": [tree.tokens for tree in self.trees],
            "matched_prompt_tokens": self.matched_tokens,
            "routed_prompt_tokens": self.prompt_tokens,
        }

    def _round_robin(self, candidates: list[int]) -> int:
        for step in range(self.num_replicas):
            index = (self._next + step) % self.num_replicas
            if index in candidates:
                self._next = index + 1
                return index
        raise AssertionError("candidates is not empty")

    def _least_loaded(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda i: (self.load[i], self.trees[i].tokens, i))

    def _cache_aware(
        self, ids: Sequence[int], candidates: list[int], cache_salt: str | None
    ) -> tuple[int, str]:
        config = self.config
        loads = [self.load[i] for i in candidates]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > config.balance_abs and busiest > config.balance_rel * idlest:
            return self._least_loaded(candidates), "balance"
        matches = {i: self.trees[i].match(ids, cache_salt) for i in candidates}
        best = max(candidates, key=lambda i: (matches[i], -self.load[i], -i))
        if ids and matches[best] > 0 and matches[best] >= config.cache_threshold * len(ids):
            self.matched_tokens += matches[best]
            return best, "cache_hit"
        return self._least_loaded(candidates), "cache_miss"
