"""The router's policies and its per-replica prefix trees (no Ray, no model)."""

from __future__ import annotations

import random

import pytest

from runtime.scale_out.prefix_tree import ApproxPrefixTree
from runtime.scale_out.routing import Router, RouterConfig
from runtime.server_args import ROUTING_POLICIES


def test_every_flag_choice_routes_and_other_names_are_refused() -> None:
    for name in ROUTING_POLICIES:
        router = Router(2, RouterConfig(policy=name))
        assert router.choose([1, 2, 3]) in (0, 1)
        assert router.decisions and sum(router.decisions.values()) == 1
    with pytest.raises(ValueError, match="router policy must be one of"):
        RouterConfig(policy="least_recent")


# ---- ApproxPrefixTree ---------------------------------------------------------------------


def test_tree_matches_the_longest_recorded_prefix() -> None:
    tree = ApproxPrefixTree(1000)
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 3, 9])  # splits the first run after [1, 2, 3]
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 3, 9, 9]) == 4
    assert tree.match([1, 2, 7]) == 2
    assert tree.match([7]) == 0
    assert tree.match([]) == 0
    assert tree.tokens == 6  # [1, 2, 3] + [4, 5] + [9]


def test_tree_inserting_a_recorded_prefix_adds_nothing() -> None:
    tree = ApproxPrefixTree(1000)
    tree.insert(list(range(10)))
    tree.insert(list(range(4)))
    assert tree.tokens == 10
    assert tree.match(list(range(4))) == 4


def test_tree_prunes_least_recently_used_first_and_stays_bounded() -> None:
    tree = ApproxPrefixTree(100)
    old = [1000 + i for i in range(40)]
    new = [2000 + i for i in range(40)]
    tree.insert(old)
    tree.insert(new)
    tree.match(old)  # old is now the more recently used
    tree.insert([3000 + i for i in range(40)])  # 120 tokens: prune to 90
    assert tree.tokens <= 90
    assert tree.match(old) == 40
    assert tree.match(new) < 40  # the least recently used lost (part of) its run
    assert tree.pruned_tokens == 120 - tree.tokens


def test_tree_keeps_each_cache_salt_apart_and_forgets_emptied_ones() -> None:
    tree = ApproxPrefixTree(100)
    tree.insert(list(range(40)), cache_salt="a")
    assert tree.match(list(range(40)), cache_salt="a") == 40
    assert tree.match(list(range(40)), cache_salt="b") == 0  # not even the first token
    assert tree.match(list(range(40))) == 0  # no salt is a salt of its own
    tree.insert(list(range(40)))
    assert tree.match(list(range(40))) == 40 and tree.tokens == 80
    tree.insert(list(range(100, 160)), cache_salt="c")  # 140 tokens: prune to 90
    assert tree.tokens <= 90 and "a" not in tree.roots  # the oldest salt went, and its root
    tree.clear()
    assert tree.roots == {} and tree.match(list(range(100, 160)), cache_salt="c") == 0


def test_tree_random_operations_against_a_set_of_sequences() -> None:
    """match equals the longest common prefix with any inserted sequence (no pruning)."""
    rng = random.Random(0)
    tree = ApproxPrefixTree(1 << 30)
    inserted: list[list[int]] = []
    for _ in range(300):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [
            rng.randint(0, 5) for _ in range(rng.randint(0, 6))
        ]
        if rng.random() < 0.5:
            tree.insert(seq)
            inserted.append(seq)
        else:
            expected = 0
            for other in inserted:
                n = 0
                while n < min(len(seq), len(other)) and seq[n] == other[n]:
                    n += 1
                expected = max(expected, n)
            assert tree.match(seq) == expected


# ---- Router ---------------------------------------------------------------------------------


def test_cache_aware_sends_a_shared_prefix_back_to_its_replica() -> None:
    router = Router(2, RouterConfig())
    header = list(range(100))
    first = router.choose(header + [500, 501])
    assert first is not None
    other = router.choose(list(range(1000, 1100)))  # no match: the idler replica
    assert other == 1 - first
    router.finished(first)
    router.finished(other)
    for tail in range(5):
        assert router.choose(header + [600 + tail]) == first
    assert router.decisions["cache_hit"] == 5


def test_cache_aware_matches_prefixes_under_the_requests_cache_salt() -> None:
    router = Router(2, RouterConfig())
    header = list(range(100))
    first = router.choose(header + [500], cache_salt="tenant-a")
    assert first is not None
    router.finished(first, header + [500, 501], cache_salt="tenant-a")
    # The same header under another salt is no hit on the first replica (its cache cannot
    # serve it): the idle replica takes it.
    assert router.choose(header + [600], cache_salt="tenant-b") == 1 - first
    assert router.choose(header + [700]) == first  # no salt: no hit either; the less loaded
    assert router.decisions == {"cache_miss": 3}
    assert router.choose(header + [800], cache_salt="tenant-a") == first
    router.assign(1 - first, header, "program", cache_salt="tenant-c")
    assert router.trees[1 - first].match(header, cache_salt="tenant-c") == 100
    assert router.decisions["cache_hit"] == 1


def test_cache_aware_records_outputs_for_the_next_turn() -> None:
    router = Router(2, RouterConfig())
    turn1 = list(range(50))
    chosen = router.choose(turn1)
    assert chosen is not None
    output = list(range(900, 960))
    router.finished(chosen, turn1 + output)
    # The next turn re-sends the history: prompt + answer + a new user message.
    assert router.choose(turn1 + output + [7, 8, 9]) == chosen
    assert router.matched_tokens == 110


def test_cache_aware_balance_overrides_affinity() -> None:
    config = RouterConfig(balance_abs=4, balance_rel=1.5)
    router = Router(2, config)
    header = list(range(64))
    chosen = router.choose(header + [1])
    for i in range(4):  # in flight on one replica, none finished
        assert router.choose(header + [2 + i]) == chosen
    assert router.load[chosen] == 5
    # 5 - 0 > 4 and 5 > 1.5 * 0: out of balance, the idle replica gets it despite the match.
    assert router.choose(header + [99]) == 1 - chosen
    assert router.decisions["balance"] == 1


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded() -> None:
    router = Router(2, RouterConfig(cache_threshold=0.5))
    a = router.choose(list(range(10)) + list(range(100, 190)))
    assert a is not None
    # 10 of 100 tokens match replica a: not worth it; the idle replica takes it.
    assert router.choose(list(range(10)) + list(range(200, 290))) == 1 - a
    assert router.decisions["cache_miss"] == 2


def test_round_robin_shortest_queue_and_random() -> None:
    rr = Router(3, RouterConfig(policy="round_robin"))
    assert [rr.choose([1]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    rr.mark_dead(1)
    assert [rr.choose([1]) for _ in range(4)] == [0, 2, 0, 2]

    sq = Router(3, RouterConfig(policy="shortest_queue"))
    assert [sq.choose([1]) for _ in range(3)] == [0, 1, 2]
    sq.finished(1)
    assert sq.choose([1]) == 1

    seen = set()
    rnd = Router(3, RouterConfig(policy="random", seed=1))
    for _ in range(60):
        chosen = rnd.choose([1])
        assert chosen is not None
        seen.add(chosen)
    assert seen == {0, 1, 2}
    assert rnd.trees[0].tokens == 0  # only cache_aware keeps trees


def test_dead_replicas_are_skipped_and_forgotten() -> None:
    router = Router(2, RouterConfig())
    header = list(range(100))
    chosen = router.choose(header)
    assert chosen is not None
    router.mark_dead(chosen)
    assert router.trees[chosen].tokens == 0
    assert router.choose(header + [1]) == 1 - chosen
    assert router.choose(header, exclude=(1 - chosen,)) is None
    router.mark_dead(1 - chosen)
    assert router.choose(header) is None
    router.mark_alive(chosen)
    assert router.choose(header) == chosen


def test_router_starts_with_no_live_replica_when_asked() -> None:
    router = Router(2, RouterConfig(), alive=False)
    assert router.choose([1, 2]) is None
    router.mark_alive(1)
    assert router.choose([1, 2]) == 1


def test_router_memory_is_bounded_per_replica() -> None:
    router = Router(2, RouterConfig(max_tree_tokens=500))
    rng = random.Random(0)
    for _ in range(200):
        chosen = router.choose([rng.randint(0, 10_000) for _ in range(50)])
        assert chosen is not None
        router.finished(chosen)
    assert all(tree.tokens <= 500 for tree in router.trees)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "nearest"},
        {"cache_threshold": 1.5},
        {"balance_abs": -1},
        {"balance_rel": 0.5},
    ],
)
def test_router_config_refuses_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


# ---- routing keys (OpenAI's prompt_cache_key) ---------------------------------------------


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_a_routing_key_sends_its_requests_to_one_replica(policy: str) -> None:
    router = Router(4, RouterConfig(policy=policy))
    rng = random.Random(0)
    first = router.choose([rng.randrange(1000) for _ in range(8)], routing_key="user-7")
    for _ in range(6):  # unrelated prompts, which no policy alone would keep together
        prompt = [rng.randrange(1000) for _ in range(8)]
        assert router.choose(prompt, routing_key="user-7") == first
    assert router.decisions["routing_key"] == 6


def test_a_routing_key_is_kept_per_cache_salt() -> None:
    router = Router(2, RouterConfig(policy="round_robin"))
    mine = router.choose([1], cache_salt="a", routing_key="k")
    theirs = router.choose([2], cache_salt="b", routing_key="k")
    assert mine != theirs  # round robin moved on: the other salt's key is a new key
    assert router.choose([3], cache_salt="b", routing_key="k") == theirs


def test_a_routing_key_gives_way_to_a_dead_replica_and_to_balance() -> None:
    router = Router(2, RouterConfig(policy="round_robin", balance_abs=2, balance_rel=1.5))
    held = router.choose([1], routing_key="k")
    assert held is not None
    router.mark_dead(held)
    moved = router.choose([1], routing_key="k")
    assert moved not in (None, held)
    router.mark_alive(held)
    for _ in range(2):  # the key's replica gets busy: 3 in flight against 0
        assert router.choose([1], routing_key="k") == moved
    assert router.choose([1], routing_key="k") == held  # out of balance: the idle one
    assert router.choose([1], routing_key="k") == held  # and the key follows it


def test_routing_keys_are_bounded() -> None:
    router = Router(2, RouterConfig(max_routing_keys=3))
    for key in range(10):
        router.choose([key], routing_key=f"k{key}")
    assert list(router.keyed) == [(None, "k7"), (None, "k8"), (None, "k9")]
