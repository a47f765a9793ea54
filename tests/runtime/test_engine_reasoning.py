"""Constraints after the reasoning, through the Engine: the thinking is free, the answer after
``</think>`` follows the constraint, with and without the overlap scheduler.

The random-weight model thinks noise; a logit_bias on ``</think>`` found by a sweep makes it
close the block after a few tokens. The unconstrained run with the same bias is the reference:
the constrained run must produce the same thinking (no mask touched it)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from runtime import Engine
from runtime.channels import QueueChannel
from runtime.ipc import GenerateRequest
from runtime.sampling_params import SamplingParams
from runtime.scheduler import grammar_manager
from runtime.scheduler.scheduler import Scheduler
from runtime.server_args import ServerArgs
from tests.runtime.helpers import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
NO_BIAS: dict[str, float] = {}


@pytest.fixture(scope="module")
def engines(thinking_model_path: Path) -> Iterator[tuple[Engine, Engine]]:
    """Overlapped (filling every mask while the forward runs, which the tiny model's fast
    fills would otherwise skip) and plain."""
    common = {"max_total_tokens": 8192, "debug_invariants": True}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar_manager, "OVERLAP_FILL_MIN_MS", 0.0)
        with Engine(thinking_model_path, **common) as overlapped:
            # The plain one has a reasoning parser too (require_reasoning), which nothing
            # else reads.
            with Engine(
                thinking_model_path,
                disable_overlap_schedule=True,
                reasoning_parser="deepseek-r1",
                **common,
            ) as plain:
                yield overlapped, plain


@pytest.fixture(scope="module")
def engine(engines: tuple[Engine, Engine]) -> Engine:
    return engines[0]


@pytest.fixture(scope="module")
def tags(engine: Engine) -> tuple[int, int]:
    start, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return start, end


def _prompt(engine: Engine, opened: bool = False, enable_thinking: bool = True) -> str:
    text = engine.tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return text + "<think>\n" if opened else text


def _greedy(bias: dict[str, float], max_new_tokens: int = 48, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "logit_bias": bias, **extra}


def _closing_bias(
    engine: Engine, prompt: str, end: int, base: dict[str, float], min_thinking: int = 3
) -> tuple[dict[str, float], list[int]]:
    """A logit_bias (``base`` plus one on ``end``) under which greedy output closes the
    reasoning after at least ``min_thinking`` tokens, and that unconstrained output through
    ``end``."""
    biases = [b / 4 for b in range(0, 80)]
    params = [_greedy({**base, str(end): b}, max_new_tokens=20) for b in biases]
    for bias, out in zip(params, engine.generate([prompt] * len(params), params), strict=True):
        ids = out["output_ids"]
        if end in ids and ids.index(end) >= min_thinking:
            return bias["logit_bias"], ids[: ids.index(end) + 1]
    raise AssertionError(f"no bias makes this model close its reasoning after {min_thinking}")


def _answer(engine: Engine, out: dict[str, Any], thinking: list[int]) -> Any:
    """The output's answer (after ``thinking``) parsed and validated; the output must have
    finished by the grammar."""
    ids = out["output_ids"]
    assert ids[: len(thinking)] == thinking, "the constraint touched the thinking"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    answer = json.loads(engine.tokenizer.decode(ids[len(thinking) :], skip_special_tokens=True))
    jsonschema.validate(answer, SCHEMA)
    return answer


def _both(engines: tuple[Engine, Engine], prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    overlapped, plain = engines
    first, second = overlapped.generate(prompt, params), plain.generate(prompt, params)
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["finish_reason"] == second["meta_info"]["finish_reason"]
    return first


@pytest.mark.parametrize("with_start", [False, True], ids=["end-only", "start-and-end"])
def test_thinking_is_free_and_the_answer_follows_the_schema(
    engines: tuple[Engine, Engine], tags: tuple[int, int], with_start: bool
):
    """deepseek-r1 style: the prompt opened the reasoning."""
    engine = engines[0]
    start, end = tags
    prompt = _prompt(engine, opened=True)
    bias, thinking = _closing_bias(engine, prompt, end, NO_BIAS)
    gate = {"reasoning_end_token_id": end}
    if with_start:
        gate["reasoning_start_token_id"] = start
    before = engine.get_server_info()["draft_tokens_proposed"]
    out = _both(engines, prompt, _greedy(bias, json_schema=SCHEMA, **gate))
    _answer(engine, out, thinking)
    # Jump-forward drafts ran after </think> ({"ok": is forced), none before.
    assert engine.get_server_info()["draft_tokens_proposed"] > before


def test_require_reasoning_gates_the_constraint_and_splits_the_output(
    engines: tuple[Engine, Engine], tags: tuple[int, int]
):
    """``require_reasoning`` sets the gate itself (no token ids given) and returns the
    thinking apart from the answer, whole and streamed; without a reasoning parser it is
    refused, naming the option."""
    overlapped, engine = engines
    _, end = tags
    prompt = _prompt(engine, opened=True)
    bias, thinking = _closing_bias(engine, prompt, end, NO_BIAS)
    params = _greedy(bias, json_schema=SCHEMA)
    out = engine.generate(prompt, params, require_reasoning=True)
    _answer(engine, out, thinking)  # the same thinking: the grammar waited for </think>
    assert out["reasoning_content"] == engine.tokenizer.decode(thinking[:-1])
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    chunks = list(engine.generate(prompt, params, require_reasoning=True, stream=True))
    assert "".join(c["reasoning_delta"] for c in chunks) == out["reasoning_content"]
    assert "".join(c["delta"] for c in chunks) == out["text"] == chunks[-1]["text"]
    assert chunks[-1]["reasoning_content"] == out["reasoning_content"]
    raw = engine.generate(prompt, params)  # no gate: the schema applies from the first token
    assert "reasoning_content" not in raw and raw["output_ids"][: len(thinking)] != thinking
    with pytest.raises(ValueError, match="require_reasoning: needs a reasoning parser"):
        overlapped.generate(prompt, params, require_reasoning=True)


def test_the_model_may_open_its_reasoning_itself(
    engines: tuple[Engine, Engine], tags: tuple[int, int]
):
    """qwen3 style: the first token is the grammar's or <think>; here <think> (biased: this
    model then repeats it, so the thinking is short)."""
    engine = engines[0]
    start, end = tags
    prompt = _prompt(engine)
    bias, thinking = _closing_bias(engine, prompt, end, {str(start): 7.0}, min_thinking=1)
    assert thinking[0] == start
    gate = {"reasoning_end_token_id": end, "reasoning_start_token_id": start}
    _answer(engine, _both(engines, prompt, _greedy(bias, json_schema=SCHEMA, **gate)), thinking)


def test_an_output_that_does_not_reason_is_constrained_from_its_first_token(
    engines: tuple[Engine, Engine], tags: tuple[int, int]
):
    engine = engines[0]
    start, end = tags
    gate = {"reasoning_end_token_id": end, "reasoning_start_token_id": start}
    no_think = {str(start): float("-inf")}
    out = _both(engines, _prompt(engine), _greedy(no_think, json_schema=SCHEMA, **gate))
    _answer(engine, out, [])


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_start(
    engines: tuple[Engine, Engine], tags: tuple[int, int]
):
    """Qwen3's template with enable_thinking=False ends in "<think>\\n\\n</think>\\n\\n"."""
    engine = engines[0]
    start, end = tags
    prompt = _prompt(engine, enable_thinking=False)
    for gate in (
        {"reasoning_end_token_id": end},
        {"reasoning_end_token_id": end, "reasoning_start_token_id": start},
    ):
        _answer(engine, _both(engines, prompt, _greedy(NO_BIAS, json_schema=SCHEMA, **gate)), [])


def test_reasoning_that_never_ends_finishes_with_length_unconstrained(
    engines: tuple[Engine, Engine], tags: tuple[int, int]
):
    engine = engines[0]
    _, end = tags
    prompt = _prompt(engine, opened=True)
    never = {str(end): float("-inf")}
    reference = engine.generate(prompt, _greedy(never, max_new_tokens=12))
    before = engine.get_server_info()["draft_tokens_proposed"]
    params = _greedy(never, max_new_tokens=12, json_schema=SCHEMA, reasoning_end_token_id=end)
    out = _both(engines, prompt, params)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert out["output_ids"] == reference["output_ids"]
    assert engine.get_server_info()["draft_tokens_proposed"] == before


def test_abort_while_thinking(engine: Engine, tags: tuple[int, int]):
    _, end = tags
    params = _greedy({str(end): float("-inf")}, 400, json_schema=SCHEMA, reasoning_end_token_id=end)
    stream = engine.generate(_prompt(engine, opened=True), params, stream=True, rid="thinker")
    chunks = [next(stream)]
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    engine.abort("thinker")
    reader.join(timeout=30)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(chunks[-1]["output_ids"]) < 400
    engine.check_invariants()


def test_retraction_keeps_where_the_reasoning_stands(
    thinking_model_path: Path, engine: Engine, tags: tuple[int, int]
):
    """Requests retracted while thinking and again while answering (their KV freed, back to
    the queue, prefilled again) give the outputs of requests never retracted."""
    _, end = tags
    opened = engine.tokenizer("<think>\n", add_special_tokens=False).input_ids
    prompts = [p + opened for p in random_prompts([60, 70, 80, 90], seed=11)]
    bias = {str(end): 5.5}  # two of them close their reasoning late, two never do
    params = _greedy(bias, 64, json_schema=SCHEMA, reasoning_end_token_id=end, ignore_eos=True)
    roomy = engine.generate(input_ids=prompts, sampling_params=params)
    closed = [o for o in roomy if end in o["output_ids"]]
    assert len(closed) >= 2
    for out in closed:
        _answer(engine, out, out["output_ids"][: out["output_ids"].index(end) + 1])

    args = ServerArgs(model_path=str(thinking_model_path), debug_invariants=True)
    outbox = QueueChannel()
    scheduler = Scheduler(args, QueueChannel(), outbox, QueueChannel())
    sampling = SamplingParams.from_dict(params)
    for i, prompt in enumerate(prompts):
        scheduler.handle(GenerateRequest(f"r{i}", prompt, sampling))
    moments = [
        lambda r: r.constraint.gate is not None and len(r.output_ids) == 8,  # thinking
        lambda r: r.constraint.matcher is not None and not r.finished,  # answering
    ]
    retracted = 0
    deadline = time.monotonic() + 120
    while scheduler.running or scheduler.waiting or scheduler.grammar.queue:
        assert time.monotonic() < deadline
        if not scheduler.running and not scheduler.waiting:
            time.sleep(0.002)  # the constraints compile on other threads
        scheduler.step()
        if moments and any(moments[0](r) for r in scheduler.running):
            moments.pop(0)
            while scheduler.running:
                victim = scheduler.decodes.retract_cheapest(scheduler.running)
                scheduler.running.remove(victim)
                scheduler.waiting.append(victim)
                retracted += 1
    scheduler.grammar.shutdown()
    assert not moments and retracted >= 4
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    scheduler._flush_outputs()
    while (batch := outbox.recv(0)) is not None:
        for o in batch.outputs:
            outputs[o.rid] += o.new_token_ids
    assert list(outputs.values()) == [o["output_ids"] for o in roomy]
    scheduler.kv.check_invariants([])
