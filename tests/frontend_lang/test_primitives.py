"""Every DSL primitive, on the in-process Engine and on a live server: text, gen, select, roles,
fork/join with cache hits, run_batch order, streaming, errors."""

from __future__ import annotations

import asyncio

import pytest

import frontend_lang as fl


@fl.function
def continue_text(s: fl.ProgramState, prefix: str, max_tokens: int = 8) -> None:
    s += prefix + fl.gen("out", max_tokens=max_tokens, temperature=0.0)


def test_gen_captures_and_appends(backend: fl.Backend):
    state = continue_text.run(prefix="def fibonacci(n):", backend=backend)
    out = state["out"]
    assert isinstance(out, str) and out
    assert state.text() == "def fibonacci(n):" + out
    meta = state.get_meta_info("out")
    assert 1 <= meta["completion_tokens"] <= 8 and meta["prompt_tokens"] > 0
    again = continue_text.run(prefix="def fibonacci(n):", backend=backend)
    assert again["out"] == out and again.get_meta_info("out")["cached_tokens"] > 0


def test_gen_stop_trims_at_the_stop_string(backend: fl.Backend):
    free = continue_text.run(prefix="import os\n", max_tokens=16, backend=backend)["out"]
    stop = free[4:7]
    assert len(stop) == 3 and stop.strip()

    @fl.function
    def stopped(s: fl.ProgramState) -> None:
        s += "import os\n" + fl.gen("out", max_tokens=16, stop=stop, temperature=0.0)

    state = stopped.run(backend=backend)
    assert state["out"] == free[: free.index(stop)]
    assert state.get_meta_info("out")["finish_reason"]["type"] == "stop"


def test_sampling_params_reach_the_runtime(backend: fl.Backend):
    greedy = continue_text.run(prefix="class Foo:", backend=backend)["out"]

    @fl.function
    def top_k_one(s: fl.ProgramState) -> None:
        s += "class Foo:" + fl.gen("out", max_tokens=8, temperature=1.0, top_k=1, min_p=0.0)

    assert top_k_one.run(backend=backend)["out"] == greedy

    @fl.function
    def penalized(s: fl.ProgramState) -> None:
        s += "class Foo:"
        s += fl.gen(
            "out", max_tokens=8, frequency_penalty=2.0, presence_penalty=2.0, temperature=0.0
        )

    # Greedy decoding repeats tokens on this model; penalties at 2.0 change the argmax.
    assert penalized.run(backend=backend)["out"] != greedy
    with pytest.raises(fl.ProgramError, match="top_p"):
        continue_text_top_p.run(backend=backend)


@fl.function
def continue_text_top_p(s: fl.ProgramState) -> None:
    s += "x" + fl.gen("out", max_tokens=2, top_p=1.5)


@fl.function
def pick(s: fl.ProgramState, choices: list[str], method: str) -> None:
    s += "The weather today is" + fl.select("pick", choices=choices, choices_method=method)


@pytest.mark.parametrize("method", fl.CHOICES_METHODS)
def test_select_returns_a_choice_with_its_scores(backend: fl.Backend, method: str):
    choices = [" sunny", " rainy with a chance of snow", " cold"]
    state = pick.run(choices=choices, method=method, backend=backend)
    meta = state.get_meta_info("pick")
    assert state["pick"] in choices
    assert state.text() == "The weather today is" + state["pick"]
    assert meta["choices"] == choices and meta["method"] == method
    assert len(meta["scores"]) == 3 and all(isinstance(x, float) for x in meta["scores"])
    token_logprobs = meta["token_logprobs"]
    assert [len(t) > 0 for t in token_logprobs] == [True] * 3
    means = [sum(t) / len(t) for t in token_logprobs]
    if method == fl.TOKEN_LENGTH_NORMALIZED:
        assert meta["scores"] == pytest.approx(means)
        assert state["pick"] == choices[means.index(max(means))]
    elif method == fl.UNCONDITIONAL_LIKELIHOOD_NORMALIZED:
        assert state["pick"] == choices[meta["scores"].index(max(meta["scores"]))]
        assert meta["scores"] != pytest.approx(means)  # the unconditional term moved them


def test_select_reuses_the_cached_prefix(backend: fl.Backend):
    prefix = "Here is a long shared preamble that both choices condition on. " * 4

    @fl.function
    def prog(s: fl.ProgramState) -> None:
        s += prefix + fl.select("pick", choices=[" yes", " no"])

    calls = prog.run(backend=backend).get_meta_info("pick")["calls"]
    for call in calls:  # everything before the scoring window came from the cache
        assert call["cached_tokens"] >= call["prompt_tokens"] - 12


@fl.function
def chat(s: fl.ProgramState, question: str) -> None:
    s += fl.system("You are terse.")
    with s.user():
        s += question
    s += fl.assistant(fl.gen("answer", max_tokens=6, temperature=0.0))
    s += fl.user("Again?")
    with s.assistant():
        s += "Sure: " + fl.gen("again", max_tokens=4, temperature=0.0)


def test_roles_render_with_the_chat_template(backend: fl.Backend, engine_backend: fl.Engine):
    state = chat.run(question="What is 2+2?", backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["answer"]
    assert messages[4]["content"] == "Sure: " + state["again"]
    tokenizer = engine_backend.engine.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == tokenizer.bos_token + state.text()  # BOS comes from tokenization


def test_fork_branches_share_the_prefix(backend: fl.Backend):
    preamble = "A shared preamble about trees and forests, long enough to matter. " * 3

    @fl.function
    def tree(s: fl.ProgramState) -> None:
        s += preamble
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"Idea {i}:" + fl.gen("idea", max_tokens=6, temperature=0.0)
        forks.join()
        s += "Best:" + fl.gen("best", max_tokens=4, temperature=0.0)

    state = tree.run(backend=backend)
    ideas, metas = state["idea"], state.get_meta_info("idea")
    assert len(ideas) == 3 and all(isinstance(idea, str) for idea in ideas)
    cached = [m["cached_tokens"] for m in metas]
    prompt = [m["prompt_tokens"] for m in metas]
    assert all(c > 0 for c in cached), cached
    assert all(c >= p - 6 for c, p in zip(cached, prompt, strict=True)), (cached, prompt)
    assert "idea" not in state.get_meta_info("best")
    assert state.text().startswith(preamble + "Best:")


def test_fork_group_append_and_branch_reads(backend: fl.Backend):
    @fl.function
    def both(s: fl.ProgramState) -> None:
        s += "Q: name a color.\n"
        forks = s.fork(2)
        forks += "A:" + fl.gen("a", max_tokens=3, temperature=0.0)
        forks[1] += " And:" + fl.gen("b", max_tokens=3, temperature=0.0)
        assert forks[0]["a"] == forks[1]["a"]  # same prefix, greedy
        forks.join()

    state = both.run(backend=backend)
    assert state["a"][0] == state["a"][1]
    assert state["b"][0] is None and isinstance(state["b"][1], str)


def test_run_batch_keeps_input_order(backend: fl.Backend):
    prefixes = [f"# item {i}\nvalue_{i} =" for i in range(6)]
    states = continue_text.run_batch(
        [{"prefix": p, "max_tokens": 4} for p in prefixes], backend=backend, progress_bar=True
    )
    assert [s.text()[: len(p)] for s, p in zip(states, prefixes, strict=True)] == prefixes
    alone = continue_text.run(prefix=prefixes[4], max_tokens=4, backend=backend)
    assert states[4]["out"] == alone["out"]


def test_streaming_yields_the_same_text(backend: fl.Backend):
    plain = chat.run(question="Stream me.", backend=backend)
    streamed = chat.run(question="Stream me.", backend=backend, stream=True)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 5
    assert "".join(pieces) == streamed.text() == plain.text()
    assert streamed["answer"] == plain["answer"]

    async def consume() -> tuple[str, str]:
        state = chat.run(question="Stream me.", backend=backend, stream=True)
        answer = "".join([piece async for piece in state.text_async_iter("answer")])
        return answer, state["answer"]

    answer, final = asyncio.run(consume())
    assert answer == final == plain["answer"]


def test_errors_surface_with_program_and_variable(backend: fl.Backend):
    @fl.function
    def bad_gen(s: fl.ProgramState) -> None:
        s += "x" + fl.gen("broken", max_tokens=-1)

    with pytest.raises(fl.ProgramError, match=r"program 'bad_gen' .* generating 'broken'") as info:
        bad_gen.run(backend=backend)
    assert info.value.program == "bad_gen" and info.value.variable == "broken"

    @fl.function
    def bad_branch(s: fl.ProgramState) -> None:
        s += "x"
        forks = s.fork(2)
        forks[0] += fl.gen("fine", max_tokens=2)
        forks[1] += fl.gen("branch_var", max_tokens=2, temperature=-1.0)
        forks.join()

    with pytest.raises(fl.ProgramError, match="'branch_var'"):
        bad_branch.run(backend=backend)

    streamed = bad_gen.run(backend=backend, stream=True)
    with pytest.raises(fl.ProgramError, match="'broken'"):
        list(streamed.text_iter())
    with pytest.raises(fl.ProgramError, match="'broken'"):
        streamed.text()

    with pytest.raises(fl.ProgramError, match="'out'"):
        continue_text.run_batch(
            [{"prefix": "a", "max_tokens": 2}, {"prefix": "b", "max_tokens": -2}],
            backend=backend,
            progress_bar=False,
        )
    with pytest.raises(TypeError, match="continue_text"):
        continue_text.run(wrong_arg=1, backend=backend)


def test_an_output_that_does_not_parse_says_how_it_finished(backend: fl.Backend):
    @fl.function
    def cut_json(s: fl.ProgramState) -> None:
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        }
        s += "Person: " + fl.gen("person", max_tokens=2, json_schema=schema, temperature=0.0)

    with pytest.raises(fl.ProgramError, match="does not parse.*finished by length"):
        cut_json.run(backend=backend)


def test_programs_compose(backend: fl.Backend):
    @fl.function
    def outer(s: fl.ProgramState) -> None:
        s += "Header.\n"
        continue_text(s, prefix="def f():", max_tokens=3)
        s += "\nEnd."

    state = outer.run(backend=backend)
    assert state.text() == "Header.\ndef f():" + state["out"] + "\nEnd."
