"""``cache_salt`` on the in-process Engine: requests reuse each other's KV only when their salts
are equal (no salt is a salt of its own), n-gram speculation proposes nothing from another
salt's tree, and a bad salt is refused before anything runs (issue 41)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import Engine
from runtime.request_checks import InvalidRequestValue
from tests.runtime.helpers import random_prompts

GREEDY = {"temperature": 0, "max_new_tokens": 1}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    # n-gram speculation drafting the most every step ("always"), so that what it proposes
    # depends on the tree and the request alone, never on measured timings.
    with Engine(
        tiny_model_path,
        max_total_tokens=8192,
        debug_invariants=True,
        speculative_algorithm="ngram",
        speculative_policy="always",
    ) as eng:
        yield eng


def _cached(engine: Engine, prompt: list[int], salt: str | None, stream: bool = False) -> int:
    if stream:
        *_, last = engine.generate(
            input_ids=prompt, sampling_params=GREEDY, stream=True, cache_salt=salt
        )
    else:
        last = engine.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt=salt)
    return int(last["meta_info"]["cached_tokens"])


def test_requests_reuse_kv_only_under_the_same_salt(engine: Engine) -> None:
    (prompt,) = random_prompts([300], seed=41)
    whole = len(prompt) - 1  # the last token always runs
    assert _cached(engine, prompt, None) == 0
    assert _cached(engine, prompt, "tenant-a") == 0  # not even the first page
    assert _cached(engine, prompt, "tenant-b", stream=True) == 0
    assert _cached(engine, prompt, "tenant-a") == whole
    assert _cached(engine, prompt, "tenant-b") == whole
    assert _cached(engine, prompt, None, stream=True) == whole  # no salt: today's cache
    assert _cached(engine, prompt, "tenant-A") == 0  # salts compare exactly
    # A batch and its samples run under the call's salt.
    batch = engine.generate(
        input_ids=[prompt, prompt[:200] + [7]],
        sampling_params=dict(GREEDY, n=2),
        cache_salt="tenant-a",
    )
    assert [r["meta_info"]["cached_tokens"] for r in batch[0]] == [whole, whole]
    assert all(r["meta_info"]["cached_tokens"] >= 199 for r in batch[1])
    engine.check_invariants()


@pytest.mark.parametrize(
    ("salt", "why"),
    [
        ("", "must not be empty"),
        ("x" * 257, "at most 256 characters"),
        ("tenant\n", "U\\+000A"),
        ("ténant", "U\\+00E9"),
        ("\ud800", "U\\+D800"),
        (7, "must be a string"),
    ],
)
def test_a_bad_salt_is_refused_naming_it(engine: Engine, salt: object, why: str) -> None:
    with pytest.raises(InvalidRequestValue, match=f"^cache_salt: .*{why}") as raised:
        engine.generate(prompt="hello", sampling_params=GREEDY, cache_salt=salt)
    assert raised.value.field == "cache_salt"
    stream = engine.generate(prompt="hi", sampling_params=GREEDY, stream=True, cache_salt=salt)
    with pytest.raises(InvalidRequestValue, match="^cache_salt"):
        next(iter(stream))
    assert engine.generate(prompt="hello", sampling_params=GREEDY, cache_salt="x" * 256)["text"]


def test_ngram_drafts_from_the_tree_stay_within_their_salt(engine: Engine) -> None:
    """A repeated prompt's continuation comes from the tree (what the first request wrote),
    but only under the salt that wrote it: another salt drafts only from its own tokens, as
    a prompt no tenant has sent does."""
    (prompt,) = random_prompts([40], seed=43)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}

    def run(salt: str) -> dict:
        return engine.generate(input_ids=prompt, sampling_params=params, cache_salt=salt)

    first = run("tenant-a")
    again = run("tenant-a")
    other = run("tenant-b")
    fresh = run("tenant-c")
    assert first["output_ids"] == again["output_ids"] == other["output_ids"] == fresh["output_ids"]
    assert again["meta_info"]["spec_accept_len"] > 3.0  # the tree's continuation, accepted
    spec = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_ct")
    assert [other["meta_info"][k] for k in spec] == [fresh["meta_info"][k] for k in spec]
    assert other["meta_info"]["spec_accepted_tokens"] < again["meta_info"]["spec_accepted_tokens"]
    engine.check_invariants()
