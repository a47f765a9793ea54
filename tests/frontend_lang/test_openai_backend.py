"""fl.OpenAI against a live ``arbor serve``'s OpenAI-compatible API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import frontend_lang as fl


@pytest.fixture(scope="module")
def openai_backend(server_url: str, tiny_model_path: Path) -> Iterator[fl.OpenAI]:
    yield fl.OpenAI(base_url=f"{server_url}/v1", model=str(tiny_model_path))


@fl.function
def complete(s: fl.ProgramState) -> None:
    s += "def fibonacci(n):" + fl.gen("body", max_tokens=8, temperature=0.0)


@fl.function
def chat(s: fl.ProgramState) -> None:
    s += fl.system("You are terse.")
    s += fl.user("Say something.")
    s += fl.assistant(fl.gen("reply", max_tokens=8, temperature=0.0))


def test_text_programs_use_completions(openai_backend: fl.OpenAI, endpoint_backend):
    state = complete.run(backend=openai_backend)
    native = complete.run(backend=endpoint_backend)
    assert state["body"] == native["body"]
    assert state.get_meta_info("body")["completion_tokens"] == 8


def test_chat_programs_use_chat_completions(openai_backend: fl.OpenAI, endpoint_backend):
    state = chat.run(backend=openai_backend)
    native = chat.run(backend=endpoint_backend)  # the same template, rendered by the DSL
    assert state["reply"] == native["reply"]
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]


def test_streaming_matches(openai_backend: fl.OpenAI):
    for program in (complete, chat):
        plain = program.run(backend=openai_backend)
        streamed = program.run(backend=openai_backend, stream=True)
        assert "".join(streamed.text_iter()) == streamed.text() == plain.text()


def test_select_through_prompt_logprobs(openai_backend: fl.OpenAI, endpoint_backend):
    @fl.function
    def pick(s: fl.ProgramState) -> None:
        s += "The answer is " + fl.select("pick", choices=["yes", "no", "maybe later"])

    state = pick.run(backend=openai_backend)
    native = pick.run(backend=endpoint_backend)
    assert state["pick"] == native["pick"]
    ours, theirs = state.get_meta_info("pick"), native.get_meta_info("pick")
    assert ours["healed_tokens"] == theirs["healed_tokens"] == 1
    assert ours["scores"] == pytest.approx(theirs["scores"], abs=1e-3)


def test_select_in_a_chat_fails_with_the_reason(openai_backend: fl.OpenAI):
    @fl.function
    def chat_pick(s: fl.ProgramState) -> None:
        s += fl.user("yes or no?")
        with s.assistant():
            s += fl.select("pick", choices=["yes", "no"])

    with pytest.raises(fl.ProgramError, match="prompt logprobs, which the OpenAI chat API"):
        chat_pick.run(backend=openai_backend)


def test_gen_must_open_the_assistant_turn(openai_backend: fl.OpenAI):
    @fl.function
    def mid_turn(s: fl.ProgramState) -> None:
        s += fl.user("hi")
        with s.assistant():
            s += "Well, " + fl.gen("rest", max_tokens=4)

    with pytest.raises(fl.ProgramError, match="must open an assistant turn"):
        mid_turn.run(backend=openai_backend)


def test_constrained_gen(openai_backend: fl.OpenAI):
    @fl.function
    def typed(s: fl.ProgramState) -> None:
        s += "Number: " + fl.gen("n", dtype=int, max_tokens=8)
        s += "\nColor: " + fl.gen("c", choices=["red", "blue"])
        s += "\nJSON: " + fl.gen("j", json_schema={"type": "boolean"}, max_tokens=8)

    state = typed.run(backend=openai_backend)
    assert isinstance(state["n"], int) and state["c"] in ("red", "blue")
    assert state.parsed("j") in (True, False)
