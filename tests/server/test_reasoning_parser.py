"""The reasoning parsers: whole outputs, every split point of a stream, and the prompt's say."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.chat.reasoning import (
    REASONING_FORMATS,
    ReasoningDelta,
    constrain_after_reasoning,
    make_reasoning_parser,
    reasoning_token_ids,
)
from runtime.sampling_params import SamplingParams
from runtime.server_args import REASONING_PARSERS, ServerArgs

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
PLAIN_PROMPT = "<|im_start|>assistant\n"

# (parser, prompt, output, reasoning, content, has_reasoning)
CASES = [
    ("qwen3", PLAIN_PROMPT, "<think>\nplan</think>\n\nanswer", "\nplan", "answer", True),
    ("qwen3", PLAIN_PROMPT, "  <think>a<b</think>c</think>", "a<b", "c</think>", True),
    (
        "qwen3",
        PLAIN_PROMPT,
        "just an answer </think> here",
        "",
        "just an answer </think> here",
        False,
    ),
    ("qwen3", PLAIN_PROMPT, '\n\n{"ok": true}', "", '{"ok": true}', False),
    ("qwen3", PLAIN_PROMPT, "<think>never closed <", "never closed <", "", True),
    ("qwen3", PLAIN_PROMPT, "<thi", "", "<thi", False),
    ("qwen3", PLAIN_PROMPT, "", "", "", False),
    ("qwen3", OPEN_PROMPT, "plan</think>answer", "plan", "answer", True),
    ("qwen3", CLOSED_PROMPT, "<think>x</think>y", "", "<think>x</think>y", False),
    ("deepseek-r1", OPEN_PROMPT, "plan\n</think>\n\nanswer", "plan\n", "answer", True),
    ("deepseek-r1", PLAIN_PROMPT, "<think>plan</think>answer", "plan", "answer", True),
    ("deepseek-r1", PLAIN_PROMPT, "plan</think>", "plan", "", True),
    ("deepseek-r1", OPEN_PROMPT, "still thinking </thi", "still thinking </thi", "", True),
    ("deepseek-r1", CLOSED_PROMPT, "answer only", "", "answer only", False),
]


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content", "has"), CASES)
def test_whole_outputs(name, prompt, output, reasoning, content, has):
    parser = make_reasoning_parser(name, prompt)
    assert parser.parse(output) == ReasoningDelta(reasoning, content)
    assert parser.has_reasoning is has


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "content", "has"), CASES)
def test_every_split_point_gives_the_same_parts(name, prompt, output, reasoning, content, has):
    for cut in range(len(output) + 1):
        for second in range(cut, len(output) + 1):
            pieces = [output[:cut], output[cut:second], output[second:]]
            assert _streamed(name, prompt, pieces) == (reasoning, content), pieces


def test_a_possible_tag_is_held_back_and_everything_else_flows():
    parser = make_reasoning_parser("qwen3", PLAIN_PROMPT)
    assert parser.feed("<th") == ReasoningDelta() and parser.phase == "opening"
    assert parser.feed("ink>step one </") == ReasoningDelta(reasoning="step one ")
    assert parser.phase == "reasoning"
    assert parser.feed("b> and </think") == ReasoningDelta(reasoning="</b> and ")
    assert parser.feed(">\n\n") == ReasoningDelta() and parser.phase == "answer"
    assert parser.feed("The answer") == ReasoningDelta(content="The answer")
    assert parser.feed(" is <think>") == ReasoningDelta(content=" is <think>")
    assert parser.finish() == ReasoningDelta()


def test_an_answer_without_reasoning_streams_at_once():
    parser = make_reasoning_parser("qwen3", PLAIN_PROMPT)
    assert parser.feed("Hello") == ReasoningDelta(content="Hello")
    assert parser.phase == "answer" and not parser.has_reasoning


@given(
    st.sampled_from(sorted(REASONING_FORMATS)),
    st.sampled_from([PLAIN_PROMPT, OPEN_PROMPT, CLOSED_PROMPT]),
    st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n"])),
    st.lists(st.integers(0, 60), max_size=6),
)
def test_streaming_equals_parsing_the_whole(name, prompt, parts, cuts):
    output = "".join(parts)
    whole = make_reasoning_parser(name, prompt).parse(output)
    bounds = sorted({min(c, len(output)) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *bounds], [*bounds, len(output)], strict=True)]
    assert _streamed(name, prompt, pieces) == (whole.reasoning, whole.content)


def test_the_registry_and_the_flag_name_the_same_parsers():
    assert tuple(REASONING_FORMATS) == REASONING_PARSERS
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        make_reasoning_parser("r1")


def test_the_flag_takes_only_known_parsers(capsys: pytest.CaptureFixture[str]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--reasoning-parser", "deepseek-r1"])
    assert ServerArgs.from_cli(args).reasoning_parser == "deepseek-r1"
    assert ServerArgs.from_cli(parser.parse_args(["--model-path", "m"])).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--reasoning-parser", "r1"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerArgs(model_path="m", reasoning_parser="r1")


def test_tag_token_ids(thinking_model_path, tiny_model_path):
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(thinking_model_path)
    assert reasoning_token_ids("qwen3", thinking) == tuple(
        thinking.convert_tokens_to_ids(["<think>", "</think>"])
    )
    plain = AutoTokenizer.from_pretrained(tiny_model_path)
    assert reasoning_token_ids("deepseek-r1", plain) == (None, None)


def _streamed(name: str, prompt: str, pieces: list[str]) -> tuple[str, str]:
    parser = make_reasoning_parser(name, prompt)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def test_constraints_start_after_the_reasoning(thinking_model_path, tiny_model_path):
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(thinking_model_path)
    start, end = thinking.convert_tokens_to_ids(["<think>", "</think>"])
    constrained = SamplingParams(json_object=True)
    qwen3 = constrain_after_reasoning("qwen3", thinking, constrained)
    assert (qwen3.reasoning_start_token_id, qwen3.reasoning_end_token_id) == (start, end)
    r1 = constrain_after_reasoning("deepseek-r1", thinking, constrained)
    assert (r1.reasoning_start_token_id, r1.reasoning_end_token_id) == (None, end)
    free = SamplingParams()
    assert constrain_after_reasoning("qwen3", thinking, free) is free
    plain = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match="<think> and </think> to be single tokens"):
        constrain_after_reasoning("qwen3", plain, constrained)
