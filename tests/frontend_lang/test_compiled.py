"""Compiled execution (``frontend_lang/compiled.py``, ``runtime/program``): traces, equality
with the interpreter, segments split at reads, KV shared and pinned, and released."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import frontend_lang as fl
from frontend_lang.backends.base import Prompt
from tests.frontend_lang.test_examples import load

GREEDY = {"temperature": 0.0}


class Counting(fl.Engine):
    """fl.Engine over the session's runtime.Engine, counting program segments and calls."""

    def __init__(self, shared: fl.Engine) -> None:
        super(fl.Engine, self).__init__(shared.chat_template)
        self.engine = shared.engine
        self.segments: list[dict[str, Any]] = []
        self.calls = 0
        self.prefixes: list[str] = []
        self._lock = threading.Lock()

    def _call(self, payload: dict[str, Any]) -> Any:
        with self._lock:
            self.calls += 1
        return super()._call(payload)

    def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._lock:
            self.segments.append(request)
        yield from super().run_program(request)

    def cache_prefix(self, prompt: Prompt) -> None:
        self.prefixes.append(prompt.text)
        super().cache_prefix(prompt)


# ---- tracing ---------------------------------------------------------------------------------


def test_trace_of_a_fork_program_has_its_graph(tmp_path: Path):
    example = load("tree_of_thought")
    graph = example.tree_of_thought.trace(problem="p", width=3, max_tokens=4)
    kinds = [n.kind for n in graph.nodes]
    assert kinds.count("fork") >= 1 and kinds.count("gen") >= 3 and "role" in kinds
    fork = graph.of_kind("fork")[0]
    branches = {n.branch for n in graph.nodes if n.branch}
    assert len(branches) == 3 and all(b.startswith("/") for b in branches)
    assert sum(1 for src, _, kind in graph.edges if src == fork.id and kind == "fork") == 3
    assert "digraph" in graph.to_dot() and f"n{fork.id} ->" in graph.to_dot()
    written = graph.render(tmp_path / "tot.png")
    assert written.exists() and written.stat().st_size > 0
    assert "fork x3" in str(graph)


@pytest.mark.parametrize(
    ("example", "program", "args", "kinds"),
    [
        ("batch_extraction", "extract", {"record": "Ann, 31, cat"}, {"gen", "select"}),
        ("multi_turn_chat", "chat", {"turns": ["hi", "and?"]}, {"gen", "role"}),
        ("rag", "rag", {"question": "what is evicted?"}, {"gen", "role"}),
        ("react_agent", "react_agent", {"question": "q"}, {"gen", "select", "dynamic"}),
        ("tree_of_thought", "tree_of_thought", {"problem": "p"}, {"fork", "gen", "dynamic"}),
        ("watch_the_cache", "review", {"diff": "- a\n+ b"}, {"fork", "gen"}),
    ],
)
def test_every_example_program_traces(example: str, program: str, args: dict, kinds: set[str]):
    graph = getattr(load(example), program).trace(**args)
    assert kinds <= {n.kind for n in graph.nodes}, str(graph)
    # Every node but the first continues another one.
    assert {dst for _, dst, _ in graph.edges} == {n.id for n in graph.nodes[1:]}
    assert graph.to_dot().count(" -> ") == len(graph.edges)


def test_trace_stops_at_the_first_read_and_marks_it_dynamic():
    agent = load("react_agent")
    graph = agent.react_agent.trace(question="q", max_steps=2, max_tokens=4)
    assert not graph.is_static and "action_0" in (graph.dynamic or "")
    assert graph.nodes[-1].kind == "dynamic"
    assert [n.kind for n in graph.nodes].count("select") == 1  # nothing past the read

    @fl.function
    def static(s: fl.ProgramState, q: str) -> None:
        s += "Q: " + q + "\nA:" + fl.gen("a", max_tokens=2)
        forks = s.fork(2)
        forks += fl.gen("b", max_tokens=2)
        forks.join()
        s += fl.select("c", choices=["x", "y"])

    graph = static.trace(q="hi")
    assert graph.is_static
    join = graph.of_kind("join")[0]
    assert sum(1 for _, dst, kind in graph.edges if dst == join.id and kind == "join") == 2
    assert graph.static_prefix(fl.CHATML) == "Q: hi\nA:"


# ---- equality with the interpreter -------------------------------------------------------------


@fl.function
def _primitives(s: fl.ProgramState, topic: str) -> None:
    s += fl.system("You write short notes.")
    with s.user():
        s += f"A note about {topic}. Pick a tone: "
        s += fl.select("tone", choices=["calm", "bright", "dry"])
    with s.assistant():
        s += "Notes:\n"
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"{i + 1}. " + fl.gen("note", max_tokens=6, stop="\n", **GREEDY)
        forks.join()


@fl.function
def _constrained(s: fl.ProgramState) -> None:
    s += "Rate it from 1 to 9: " + fl.select("pick", choices=["low", "high"])
    s += "\nScore: " + fl.gen("score", dtype=int, max_tokens=4, **GREEDY)


@fl.function
def _json(s: fl.ProgramState) -> None:
    s += "Give a record.\n"
    s += fl.gen(
        "record",
        max_tokens=48,
        json_schema={
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
        **GREEDY,
    )


@pytest.mark.parametrize("program", [_primitives, _constrained, _json])
def test_compiled_equals_interpreted_where_no_output_is_re_tokenized(
    backend: fl.Backend, program: fl.Function
):
    """Each gen here is the last call of its branch (selects and text come before), so the
    interpreter never re-tokenizes generated text: greedy results must be the same."""
    args = {"topic": "caches"} if program is _primitives else {}
    interpreted = program.run(backend=backend, compile=False, **args)
    compiled = program.run(backend=backend, compile=True, **args)
    assert compiled.text() == interpreted.text()
    assert compiled.messages() == interpreted.messages()
    for name in interpreted._vars:
        assert compiled[name] == interpreted[name], name
        assert compiled.parsed(name) == interpreted.parsed(name), name
    if program is _primitives:
        meta = compiled.get_meta_info("note")
        assert all(m["reused_tokens"] > 0 and m["cached_tokens"] > 0 for m in meta)
        assert all(m["reencoded_tokens"] < m["prompt_tokens"] for m in meta)
        plain = interpreted.get_meta_info("note")
        assert all(m["reencoded_tokens"] == m["prompt_tokens"] for m in plain)


def test_compiled_keeps_generated_tokens_and_continues_in_place(engine_backend: fl.Engine):
    """After a gen, the next call continues the model's own tokens: its prompt is the
    previous prompt plus the kept output plus the healed new text, nearly all re-used."""

    @fl.function
    def chain(s: fl.ProgramState) -> None:
        s += "Story: once"
        for i in range(3):
            s += fl.gen(f"part{i}", max_tokens=5, **GREEDY) + f" (part {i})"

    state = chain.run(backend=engine_backend)
    metas = [state.get_meta_info(f"part{i}") for i in range(3)]
    for before, after in zip(metas, metas[1:], strict=False):
        assert after["reused_tokens"] >= before["prompt_tokens"] + before["completion_tokens"] - 5
        assert after["reencoded_tokens"] <= 10
        assert after["cached_tokens"] >= after["reused_tokens"] - 16  # a page at most
    assert all(m["finish_reason"]["type"] == "length" for m in metas)


# ---- segments, callbacks, streaming ------------------------------------------------------------


def test_python_reads_split_segments_and_values_flow_back(engine_backend: fl.Engine):
    counting = Counting(engine_backend)
    seen: list[str] = []

    @fl.function
    def agent(s: fl.ProgramState) -> None:
        s += "Task: add numbers.\n"
        for step in range(2):
            s += f"Step {step}: " + fl.select(f"act{step}", choices=["add", "stop"])
            action = s[f"act{step}"]  # a read: the segment ends here
            seen.append(action)
            s += f"\nTool said: {len(action)}\n"
        s += "Done:" + fl.gen("end", max_tokens=3, **GREEDY)

    state = agent.run(backend=counting)
    assert seen == [state["act0"], state["act1"]]
    assert f"Tool said: {len(seen[1])}\nDone:" in state.text()
    assert len(counting.segments) == 3  # two reads split the program in three
    assert counting.calls == 0  # nothing went through the interpreter
    ids = {s.get("program_id") for s in counting.segments[1:]}
    assert len(ids) == 1 and None not in ids  # one program across its segments
    assert counting.segments[-1]["end"] is True
    assert engine_backend.engine.get_server_info()["num_pinned_programs"] == 0
    engine_backend.engine.check_invariants()


def test_streamed_compiled_run_yields_the_same_text(engine_backend: fl.Engine):
    state = _primitives.run(backend=engine_backend, stream=True, topic="trees")
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()
    again = _primitives.run(backend=engine_backend, topic="trees")
    assert again.text() == state.text()


def test_streamed_deltas_count_the_gens_tokens(engine_backend: fl.Engine):
    events = list(
        engine_backend.engine.run_program(
            {"branches": {"": [
                {"type": "text", "text": "Count:"},
                {"type": "gen", "name": "g", "sampling_params": {
                    "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}},
            ]}, "stream": True, "end": True}
        )
    )  # fmt: skip
    deltas = [e for e in events if e["type"] == "delta"]
    (gen,) = [e for e in events if e["type"] == "gen"]
    counts = [e["completion_tokens"] for e in deltas]
    assert counts == sorted(counts) and counts[-1] == gen["meta_info"]["completion_tokens"] == 6
    assert "".join(e["text"] for e in deltas) == gen["text"]


def test_a_failing_branch_raises_at_join_and_the_rest_runs(engine_backend: fl.Engine):
    @fl.function
    def bad(s: fl.ProgramState) -> None:
        s += "x"
        forks = s.fork(2)
        forks[0] += fl.gen("fine", max_tokens=2)
        forks[1] += fl.gen("broken", max_tokens=2, temperature=-1.0)
        forks.join()
        s += fl.gen("after", max_tokens=2)

    with pytest.raises(fl.ProgramError, match="'broken'") as info:
        bad.run(backend=engine_backend)
    assert info.value.variable == "broken"
    assert engine_backend.engine.get_server_info()["num_pinned_programs"] == 0
    engine_backend.engine.check_invariants()


# ---- KV sharing, pinning and release -------------------------------------------------------------


def test_fork_branches_share_the_parents_kv_slots(engine_backend: fl.Engine):
    engine = engine_backend.engine
    preamble = "Shared preamble line. " * 30

    @fl.function
    def fan(s: fl.ProgramState) -> None:
        s += preamble
        forks = s.fork(4)
        for i, branch in enumerate(forks):
            branch += f" branch {i}:" + fl.gen("x", max_tokens=3, **GREEDY)
        forks.join()

    assert engine.flush_cache()
    fan.run(backend=engine_backend)
    tree = engine.scheduler.kv.tree
    preamble_ids = engine.tokenizer(preamble).input_ids
    match = tree.match_prefix(preamble_ids)
    assert match.length >= len(preamble_ids) - 16
    # The preamble's KV is held once: the whole tree is one preamble plus four short tails.
    assert tree.total_size() < len(preamble_ids) + 4 * 40
    assert engine.get_server_info()["num_program_pins"] == 0
    engine.check_invariants()


def test_a_fork_after_a_gen_starts_its_branches_at_once(engine_backend: fl.Engine):
    """The few tokens after a gen are prefilled by each branch, not by a request of their own
    that the branches would wait a step for; the gen's KV is still shared."""
    engine = engine_backend.engine

    @fl.function
    def step_then_fan(s: fl.ProgramState) -> None:
        s += "Think first, then branch out. " * 8 + fl.gen("first", max_tokens=4, **GREEDY)
        s += "\n"
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"Option {i}:" + fl.gen("x", max_tokens=3, **GREEDY)
        forks.join()

    assert engine.flush_cache()
    before = engine.get_server_info()["requests_finished"]
    state = step_then_fan.run(backend=engine_backend)
    assert engine.get_server_info()["requests_finished"] - before == 1 + 3  # no prefix request
    tree = engine.scheduler.kv.tree
    first = state.get_meta_info("first")
    shared = first["prompt_tokens"] + first["completion_tokens"]
    assert tree.total_size() < shared + 3 * 16  # the gen's KV once, three short tails
    assert engine.get_server_info()["num_program_pins"] == 0
    engine.check_invariants()


def test_pins_hold_between_segments_and_go_when_the_program_ends(engine_backend: fl.Engine):
    engine = engine_backend.engine
    pinned: list[int] = []

    @fl.function
    def two_segments(s: fl.ProgramState) -> None:
        s += "Keep this prefix pinned while Python runs. " * 4
        s += fl.gen("a", max_tokens=3, **GREEDY)
        s["a"]  # segment boundary: the program waits here, its KV pinned
        pinned.append(engine.get_server_info()["num_program_pins"])
        assert not engine.flush_cache()  # pinned KV cannot be flushed away
        s += " then" + fl.gen("b", max_tokens=3, **GREEDY)

    state = two_segments.run(backend=engine_backend)
    assert pinned == [1]
    assert state.get_meta_info("b")["cached_tokens"] >= state.get_meta_info("a")["prompt_tokens"]
    info = engine.get_server_info()
    assert info["num_program_pins"] == 0 and info["num_pinned_programs"] == 0
    engine.check_invariants()


def test_a_program_stopped_midway_releases_every_pin(engine_backend: fl.Engine):
    engine = engine_backend.engine

    @fl.function
    def crashes(s: fl.ProgramState) -> None:
        s += "Before the crash." + fl.gen("a", max_tokens=2, **GREEDY)
        forks = s.fork(2)
        forks += fl.gen("b", max_tokens=2, **GREEDY)
        s["a"]
        raise RuntimeError("the program's own bug")

    with pytest.raises(RuntimeError, match="own bug"):
        crashes.run(backend=engine_backend)
    assert engine.get_server_info()["num_pinned_programs"] == 0

    # A caller that stops reading a segment's events ends the program.
    events = engine.run_program(
        {"branches": {"": [
            {"type": "text", "text": "Long one:"},
            {"type": "gen", "name": "g", "sampling_params": {"max_new_tokens": 64}},
            {"type": "gen", "name": "h", "sampling_params": {"max_new_tokens": 64}},
        ]}, "stream": True}
    )  # fmt: skip
    for event in events:
        if event["type"] == "delta":
            break
    events.close()
    deadline = 50
    while engine.get_server_info()["num_pinned_programs"] and deadline:
        deadline -= 1
        threading.Event().wait(0.1)
    assert engine.get_server_info()["num_pinned_programs"] == 0
    engine.check_invariants()


# ---- batch prefix prefetch ---------------------------------------------------------------------


@fl.function
def _with_header(s: fl.ProgramState, item: str) -> None:
    s += "You are a careful assistant who classifies items into categories. " * 3
    s += f"Item: {item}\nCategory:" + fl.gen("cat", max_tokens=2, **GREEDY)


def test_run_batch_prefills_the_common_static_prefix_once(engine_backend: fl.Engine):
    counting = Counting(engine_backend)
    assert engine_backend.engine.flush_cache()
    states = _with_header.run_batch(
        [{"item": f"thing {i}"} for i in range(6)], backend=counting, progress_bar=False
    )
    assert len(counting.prefixes) == 1
    assert counting.prefixes[0].startswith("You are a careful") and "Item:" in counting.prefixes[0]
    header = len(engine_backend.engine.tokenizer(counting.prefixes[0]).input_ids)
    assert all(s.get_meta_info("cat")["cached_tokens"] >= header - 16 for s in states)


# ---- the HTTP endpoint -------------------------------------------------------------------------


def test_program_endpoint_refuses_bad_requests_and_keeps_serving(server_url: str):
    with httpx.Client(base_url=server_url, timeout=60) as client:
        bad = [
            [],
            {"branches": []},
            {"branches": {"": [{"type": "nope"}]}},
            {"branches": {"": [{"type": "text"}]}},
            {"branches": {"": [{"type": "select", "choices": []}]}},
            {"branches": {"": [{"type": "fork", "id": -1, "branches": [[]]}]}},
            {"branches": {"bogus": []}},
            {"branches": {"/9.9": [{"type": "text", "text": "x"}]}},
            {"branches": {"": []}, "surprise": 1},
        ]
        for body in bad:
            response = client.post("/program", json=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["message"]
        assert client.delete("/program/never-was").status_code == 404
        ok = client.post(
            "/program",
            json={"branches": {"": [
                {"type": "text", "text": "Hello"},
                {"type": "gen", "name": "g", "sampling_params": {"max_new_tokens": 2}},
                {"type": "gen", "name": "bad", "sampling_params": {"max_new_tokens": -1}},
            ]}, "end": True},
        )  # fmt: skip
        assert ok.status_code == 200
        kinds = [e["type"] for e in ok.json()["events"]]
        assert kinds == ["program", "gen", "error", "done"]
        assert ok.json()["events"][2]["name"] == "bad"
        again = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        assert client.post("/generate", json=again).status_code == 200


def test_nested_forks_run_and_equal_the_interpreter(engine_backend: fl.Engine):
    @fl.function
    def tree(s: fl.ProgramState) -> None:
        s += "Root.\n"
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f"Level one {i}: " + fl.select("first", choices=["a", "b"])
            inner = branch.fork(2)
            for j, leaf in enumerate(inner):
                leaf += f" level two {j}: " + fl.gen("leaf", max_tokens=3, **GREEDY)

    compiled = tree.run(backend=engine_backend)
    interpreted = tree.run(backend=engine_backend, compile=False)
    leaves = lambda state: [  # noqa: E731
        leaf.text() for branch in state._run.branches for leaf in [branch] if "leaf" in leaf
    ]
    assert sorted(leaves(compiled)) == sorted(leaves(interpreted))
    assert len(leaves(compiled)) == 4
    engine_backend.engine.check_invariants()


def _slow_branch_replays(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Make every fork branch's replay of a gen slow, so a branch it forks is started late."""
    import frontend_lang.compiled as compiled_module

    real = compiled_module.execute

    def slow(state: fl.ProgramState, item: Any) -> None:
        if state._worker is not None and isinstance(item, fl.ir.Seq | fl.ir.Gen):
            time.sleep(delay_s)
        real(state, item)

    monkeypatch.setattr(compiled_module, "execute", slow)


@fl.function
def _grandchildren(s: fl.ProgramState) -> None:
    s += "Root.\n"
    for i, branch in enumerate(s.fork(2)):
        branch += f"Step {i}: " + fl.gen("step", max_tokens=2, **GREEDY) + "\n"
        for j, leaf in enumerate(branch.fork(2)):
            leaf += f"Leaf {j}: " + fl.select("sound", choices=["yes", "no"])
            s.set_var(f"scores_{i}_{j}", leaf.get_meta_info("sound")["scores"], None, None)


def test_reading_a_branch_waits_for_its_parents_replay_to_start_it(
    engine_backend: fl.Engine, monkeypatch: pytest.MonkeyPatch
):
    """A branch forked by a branch in the same segment is started by its parent's replay on
    another thread: a read of it (here right after the segment) waits for that rather than
    finding nothing queued and missing the variable (seen on a GPU over HTTP)."""
    _slow_branch_replays(monkeypatch, 0.2)
    state = _grandchildren.run(backend=engine_backend)
    interpreted = _grandchildren.run(backend=engine_backend, compile=False)
    for i in range(2):
        for j in range(2):
            assert len(state[f"scores_{i}_{j}"]) == 2
            assert state[f"scores_{i}_{j}"] == pytest.approx(interpreted[f"scores_{i}_{j}"])
    engine_backend.engine.check_invariants()


def test_a_branch_whose_parent_fails_before_starting_it_raises_on_read(
    engine_backend: fl.Engine,
):
    """The parent's replay fails (its gen is refused) before it reaches the fork: reading the
    unstarted grandchild raises that error instead of waiting for ever."""

    @fl.function
    def failing(s: fl.ProgramState) -> None:
        s += "Root.\n"
        branch = s.fork(2)[0]
        branch += fl.gen("step", max_tokens=2, temperature=-1.0)
        leaf = branch.fork(2)[0]
        leaf += fl.gen("leaf", max_tokens=2, **GREEDY)
        leaf["leaf"]

    started = time.monotonic()
    with pytest.raises(fl.ProgramError, match="'step'"):
        failing.run(backend=engine_backend)
    assert time.monotonic() - started < 60
    assert engine_backend.engine.get_server_info()["num_pinned_programs"] == 0
    engine_backend.engine.check_invariants()


def test_a_server_without_programs_falls_back_to_the_interpreter(engine_backend: fl.Engine):
    class Old(Counting):
        def run_program(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
            self.segments.append(request)
            raise fl.backends.base.ProgramsUnsupported("no /program here")

    old = Old(engine_backend)
    state = _primitives.run(backend=old, topic="caches")
    assert len(old.segments) == 1 and old.calls > 0  # tried once, then interpreted
    assert state.text() == _primitives.run(backend=engine_backend, topic="caches").text()
