"""A failure while handling one request fails that request alone: at every per-request stage of
the scheduler and the detokenizer, an exception injected for one request of a running batch
gives that request an error, and every other request finishes with its unchanged output."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine, RequestError
from tests.runtime.helpers import random_prompts

pytestmark = pytest.mark.timeout(300)

PROMPTS = random_prompts([7, 11, 5, 9], seed=71)
VICTIM = 1  # index of the request every injected failure targets
BASE = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PARAMS = [
    {**BASE, "regex": "[a-z]{1,30}"},
    # The victim has a constraint and a stop regex, so every stage runs for it.
    {**BASE, "regex": "[a-z ]{1,40}", "stop_regex": "zzz", "skip_special_tokens": False},
    dict(BASE),
    {**BASE, "temperature": 0.8, "seed": 5},
]


class Injected(RuntimeError):
    """The failure the tests inject."""


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[Engine]:
    with Engine(tiny_model_path, max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[dict[str, Any]]:
    outcomes = _run_together(engine)
    assert all(isinstance(o, dict) for o in outcomes), outcomes
    return outcomes


def _run_together(engine: Engine) -> list[Any]:
    async def run() -> list[Any]:
        calls = [
            engine.async_generate(input_ids=ids, sampling_params=params)
            for ids, params in zip(PROMPTS, PARAMS, strict=True)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(run())


def _is_victim_req(req: Any) -> bool:
    return list(req.input_ids) == PROMPTS[VICTIM]


def _raising(original: Callable[..., Any], hit: Callable[..., bool]) -> Callable[..., Any]:
    """``original``, raising Injected whenever ``hit(*args)`` holds."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if hit(*args, **kwargs):
            raise Injected("injected failure")
        return original(*args, **kwargs)

    return wrapper


def _inject(stage: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = engine.scheduler
    if stage == "admitting":
        target, name = scheduler, "_validate"
        hit: Callable[..., bool] = lambda msg: list(msg.input_ids) == PROMPTS[VICTIM]  # noqa: E731
    elif stage == "compiling":
        target, name = scheduler.grammar.service, "submit_lowered"
        hit = lambda lowered: "[a-z ]" in lowered.spec.spec  # noqa: E731
    elif stage == "masking":
        target, name = scheduler.sampler, "grammar_mask"
        hit = lambda logits, reqs: any(map(_is_victim_req, reqs))  # noqa: E731
    elif stage == "sampling":
        target, name = scheduler.sampler, "_draw"
        hit = lambda logits, reqs, *_: any(map(_is_victim_req, reqs))  # noqa: E731
    elif stage == "stop-checking":
        target, name = scheduler.outputs.stop_checker, "check"
        hit = lambda req, **_: _is_victim_req(req)  # noqa: E731
    elif stage == "detokenizing":
        target, name = engine.detokenizer, "_process_one"
        hit = lambda out: not out.skip_special_tokens  # noqa: E731
    else:
        raise AssertionError(stage)
    monkeypatch.setattr(target, name, _raising(getattr(target, name), hit))


STAGES = ["admitting", "compiling", "masking", "sampling", "stop-checking", "detokenizing"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_fails_only_its_request(
    stage: str,
    engine: Engine,
    reference: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
):
    _inject(stage, engine, monkeypatch)
    outcomes = _run_together(engine)
    monkeypatch.undo()

    victim = outcomes[VICTIM]
    assert isinstance(victim, RequestError), victim
    assert victim.status_code == 500
    assert "internal error" in str(victim) and "Injected" not in str(victim)
    for i, (outcome, expected) in enumerate(zip(outcomes, reference, strict=True)):
        if i == VICTIM:
            continue
        assert isinstance(outcome, dict), (i, outcome)
        assert outcome["output_ids"] == expected["output_ids"], i
        assert outcome["text"] == expected["text"], i
    _assert_idle(engine)
    # The engine keeps serving: the victim's request now succeeds unchanged.
    again = engine.generate(input_ids=PROMPTS[VICTIM], sampling_params=PARAMS[VICTIM])
    assert again["output_ids"] == reference[VICTIM]["output_ids"]


def _assert_idle(engine: Engine) -> None:
    engine.check_invariants()
    info = engine.get_server_info()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["num_grammar_queue_reqs"] == 0 and info["kv_used_tokens"] == 0


def test_a_row_with_no_allowed_token_fails_alone(engine: Engine, reference: list[dict[str, Any]]):
    """Every token banned by logit_bias: a 400 for that request, the batch unaffected."""
    vocab = engine.get_server_info()["vocab_size"]
    banned = {**BASE, "logit_bias": {str(t): float("-inf") for t in range(vocab)}}

    async def run() -> list[Any]:
        calls = [
            engine.async_generate(input_ids=ids, sampling_params=params)
            for ids, params in zip(PROMPTS, PARAMS, strict=True)
        ]
        calls.append(engine.async_generate(input_ids=PROMPTS[0], sampling_params=banned))
        return await asyncio.gather(*calls, return_exceptions=True)

    *outcomes, rejected = asyncio.run(run())
    assert isinstance(rejected, RequestError) and rejected.status_code == 400
    assert "no token is allowed" in str(rejected)
    assert [o["output_ids"] for o in outcomes] == [r["output_ids"] for r in reference]
    _assert_idle(engine)
