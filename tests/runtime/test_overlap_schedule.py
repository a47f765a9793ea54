"""The overlap scheduler (the default) gives the same outputs as the plain one, and an abort that
arrives while a forward runs waits for the forward before freeing anything."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine
from runtime.channels import QueueChannel
from runtime.ipc import AbortRequest, FinishReason, GenerateRequest, TokenOutputBatch
from runtime.sampling_params import SamplingParams
from runtime.scheduler import grammar_manager
from runtime.scheduler.scheduler import Scheduler
from runtime.server_args import ServerArgs
from tests.grammar.schema_corpus import SCHEMAS
from tests.runtime.helpers import random_prompts

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "1, 2, 3,", "Hello"]
SCHEMA = dict(SCHEMAS)["event"]


def _outputs(outs: list[Any]) -> list[tuple[list[int], Any]]:
    """(tokens, finish reason) of each output; with n > 1, of each sample of each prompt."""
    flat = [o for group in outs for o in (group if isinstance(group, list) else [group])]
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in flat]


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path) -> Iterator[tuple[Engine, Engine]]:
    common = {"max_total_tokens": 4096, "debug_invariants": True}
    with Engine(tiny_model_path, **common) as overlapped:
        assert overlapped.scheduler.overlap
        with Engine(tiny_model_path, disable_overlap_schedule=True, **common) as plain:
            assert not plain.scheduler.overlap
            yield overlapped, plain


def _both(engines: tuple[Engine, Engine], *args: Any, **kwargs: Any) -> list[Any]:
    overlapped, plain = engines
    first = _outputs(overlapped.generate(*args, **kwargs))
    second = _outputs(plain.generate(*args, **kwargs))
    assert first == second
    return first


def test_greedy_and_seeded_sampling(engines: tuple[Engine, Engine]) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    _both(engines, PROMPTS, greedy)
    sampled = [
        {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": i, "max_new_tokens": 24}
        for i in range(len(PROMPTS))
    ]
    _both(engines, PROMPTS, sampled)
    penalties = {"temperature": 0.7, "seed": 3, "frequency_penalty": 0.5, "max_new_tokens": 16}
    _both(engines, PROMPTS, penalties)


def test_stop_strings_and_n(engines: tuple[Engine, Engine]) -> None:
    overlapped, _ = engines
    text = overlapped.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 24})["text"]
    stop = text[5:8] or "e"
    outs = _both(engines, PROMPTS, {"temperature": 0, "max_new_tokens": 24, "stop": [stop]})
    assert any(reason["type"] == "stop" for _, reason in outs)
    _both(engines, PROMPTS[:2], {"temperature": 0.8, "seed": 5, "n": 3, "max_new_tokens": 12})


def test_grammars_with_and_without_drafts(
    engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny model's fills are fast: fill during every forward anyway, to test that path.
    monkeypatch.setattr(grammar_manager, "OVERLAP_FILL_MIN_MS", 0.0)
    grammar = engines[0].scheduler.grammar
    prepare = grammar.prepare_masks
    prepared: list[bool] = []

    def counting(reqs: Any, device: Any) -> None:
        prepare(reqs, device)
        prepared.append(grammar._prepared is not None)

    grammar.prepare_masks = counting  # type: ignore[method-assign]
    for temperature in (0, 1.0):
        params = [
            {"json_schema": SCHEMA, "temperature": temperature, "seed": i, "max_new_tokens": 96}
            for i in range(3)
        ]
        params.append({"regex": r"[a-z]{2,6}-[0-9]{3}", "temperature": temperature, "seed": 9})
        params.append({"temperature": temperature, "seed": 4, "max_new_tokens": 20})
        _both(engines, PROMPTS, params)
    grammar.prepare_masks = prepare  # type: ignore[method-assign]
    assert sum(prepared) > 20  # the overlapped engine filled its masks during forwards


def test_on_cpu_masks_are_filled_beside_the_forward_only_when_fills_are_slow(
    engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Slow" is 20 ms here, not the product's 1 ms: the tiny model's fills (about 0.2 ms quiet)
    # can pass 1 ms on a loaded machine, never 20, so the average surely falls below it.
    monkeypatch.setattr(grammar_manager, "OVERLAP_FILL_MIN_MS", 20.0)
    overlapped, _ = engines
    grammar = overlapped.scheduler.grammar
    calls: list[tuple[bool, float]] = []
    prepare = grammar.prepare_masks

    def recording(reqs: Any, device: Any) -> None:
        before = grammar.fill_ms
        prepare(reqs, device)
        if any(r.constraint.matcher is not None for r in reqs):  # not steps that only verify drafts
            calls.append((grammar._prepared is not None, before))

    grammar.prepare_masks = recording  # type: ignore[method-assign]
    try:
        params = {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": 32}
        grammar.fill_ms = 500.0  # as after slow fills: the first steps (about 15) fill ahead
        overlapped.generate(PROMPTS[0], params)
    finally:
        grammar.prepare_masks = prepare  # type: ignore[method-assign]
    ahead = [done for done, before in calls if before >= grammar_manager.OVERLAP_FILL_MIN_MS]
    behind = [done for done, before in calls if before < grammar_manager.OVERLAP_FILL_MIN_MS]
    assert ahead and all(ahead)
    assert behind and not any(behind)  # the tiny model's fills are fast: the average fell
    assert grammar.fill_ms < grammar_manager.OVERLAP_FILL_MIN_MS


def test_retraction(tiny_model_path: Path) -> None:
    """A pool too small for every decode retracts requests; overlap changes none of it."""
    prompts = random_prompts([60, 70, 80, 90], seed=11)
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    outs = []
    retracted = []
    for disable in (False, True):
        with Engine(
            tiny_model_path, max_total_tokens=360, disable_overlap_schedule=disable
        ) as engine:
            outs.append(_outputs(engine.generate(input_ids=prompts, sampling_params=params)))
            retracted.append(engine.get_server_info()["num_retracted_reqs"])
            engine.check_invariants()
    assert outs[0] == outs[1]
    assert retracted[0] >= 1 and retracted[1] >= 1


def test_abort_during_a_forward_is_carried_out_after_it(tiny_model_path: Path) -> None:
    inbox, out = QueueChannel(), QueueChannel()
    args = ServerArgs(model_path=str(tiny_model_path), max_total_tokens=2048)
    scheduler = Scheduler(args, inbox, out, QueueChannel())
    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([20, 30], seed=2)):
        scheduler.handle(GenerateRequest(f"r{i}", prompt, params))
    scheduler.step()  # both prefilled
    victim = next(r for r in scheduler.running if r.rid == "r0")
    forward = scheduler.runner.forward
    released_during_forward: list[bool] = []
    entered, proceed = threading.Event(), threading.Event()

    def slow_forward(batch: Any) -> Any:
        entered.set()
        assert proceed.wait(10)
        released_during_forward.append(victim.kv.row is None)
        return forward(batch)

    scheduler.runner.forward = slow_forward  # type: ignore[method-assign]
    inbox.send(AbortRequest("r0"))
    stepping = threading.Thread(target=scheduler.step)
    stepping.start()
    assert entered.wait(10)
    proceed.set()
    stepping.join(10)
    assert released_during_forward == [False]  # the forward still had its KV
    assert victim.kv.row is None and victim not in scheduler.running
    scheduler.runner.forward = forward  # type: ignore[method-assign]
    while scheduler.running:
        scheduler.step()
    finished = {}
    while (batch := out.recv(0)) is not None:
        assert isinstance(batch, TokenOutputBatch)
        finished.update({o.rid: o.finished_reason for o in batch.outputs if o.finished_reason})
    assert finished["r0"].type == "abort"
    assert finished["r1"] == FinishReason.cut(50)
    scheduler.kv.check_invariants([])


def test_the_flag_parses() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(["--model-path", "m", "--disable-overlap-schedule"])
    assert parsed.disable_overlap_schedule is True


def test_the_forward_thread_names_an_indexed_cuda_device(monkeypatch: pytest.MonkeyPatch):
    """torch.cuda.set_device refuses a bare "cuda" (every Engine on a GPU died at its first
    forward): the forward thread gives it an index."""
    from runtime.scheduler import scheduler

    seen: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    scheduler._forward_thread_setup(torch.device("cuda"))
    scheduler._forward_thread_setup(torch.device("cuda", 1))
    scheduler._forward_thread_setup(torch.device("cpu"))
    assert seen == [0, torch.device("cuda", 1)]
    assert not torch.is_grad_enabled()
    torch.set_grad_enabled(True)
