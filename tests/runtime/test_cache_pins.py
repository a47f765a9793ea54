"""``pin_ttl_s`` on the in-process Engine: a finished request's prompt and output stay cached
through traffic several times the KV pool, where an unpinned one is evicted, and a bad TTL is
refused before anything runs (issue 55)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Engine
from runtime.request_checks import InvalidRequestValue
from tests.runtime.helpers import random_prompts

GREEDY = {"temperature": 0, "max_new_tokens": 1}
POOL = 1024


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    with Engine(tiny_model_path, max_total_tokens=POOL, debug_invariants=True) as eng:
        yield eng


def _cached(engine: Engine, prompt: list[int], pin_ttl_s: float | None = None) -> int:
    if pin_ttl_s is None:
        result = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    else:
        result = engine.generate(input_ids=prompt, sampling_params=GREEDY, pin_ttl_s=pin_ttl_s)
    return int(result["meta_info"]["cached_tokens"])


def test_a_pinned_conversation_survives_a_flood_an_unpinned_one_does_not(engine: Engine) -> None:
    pinned, unpinned, *flood = random_prompts([200] * 14, seed=55)
    assert _cached(engine, pinned, pin_ttl_s=60) == 0
    assert _cached(engine, unpinned) == 0
    for prompt in flood:  # 2400 tokens through a 1024-token pool
        _cached(engine, prompt)
    assert _cached(engine, pinned) == len(pinned) - 1  # the last token always runs
    assert _cached(engine, unpinned) < 50


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), "30"])
def test_a_bad_pin_ttl_is_refused(engine: Engine, ttl: object) -> None:
    with pytest.raises(InvalidRequestValue, match="pin_ttl_s"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, pin_ttl_s=ttl)  # type: ignore[arg-type]
