"""Every example runs on the tiny test model with short outputs (in-process Engine)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import frontend_lang as fl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_react_agent_calls_the_chosen_tools(engine_backend: fl.Engine):
    example = load("react_agent")
    state = example.main(engine_backend, max_tokens=4, max_steps=2)
    actions = [state[f"action_{i}"] for i in range(2) if f"action_{i}" in state]
    assert actions and all(a in example.TOOLS for a in actions)
    if actions[0] != "finish":
        assert "Observation: " in state.text()
    assert example.calculator("14 - 2.1") == "11.9" and "error" in example.calculator("2**9")
    assert "Tokyo" in example.lookup("tokyo population")


def test_tree_of_thought_forks_and_judges(engine_backend: fl.Engine):
    state = load("tree_of_thought").main(engine_backend, max_tokens=4, width=3)
    assert len(state["approach"]) == 3 and set(state["sound"]) <= {"yes", "no"}
    assert all(m["cached_tokens"] > 0 for m in state.get_meta_info("approach"))
    assert isinstance(state["answer"], str)


def test_multi_turn_chat_reuses_the_history(engine_backend: fl.Engine):
    state = load("multi_turn_chat").main(engine_backend, max_tokens=4)
    assert [m["role"] for m in state.messages()].count("assistant") == 3
    assert state.get_meta_info("reply_2")["cached_tokens"] > 0


def test_rag_answers_match_the_schema(engine_backend: fl.Engine):
    example = load("rag")
    assert example.retrieve("what is evicted when memory runs out")[0] == 2
    for state in example.main(engine_backend, max_tokens=96):
        answer = state.parsed("answer")
        assert set(answer) == {"answer", "source"} and 0 <= answer["source"] < len(example.CORPUS)


def test_batch_extraction_keeps_order_and_types(engine_backend: fl.Engine):
    example = load("batch_extraction")
    rows = example.main(engine_backend, max_tokens=4)
    assert len(rows) == len(example.RECORDS)
    for row in rows:
        assert isinstance(row["age"], int) and row["kind"] in ("person", "company", "place")


def test_watch_the_cache_shares_histories_and_forks(engine_backend: fl.Engine):
    states = load("watch_the_cache").main(engine_backend, rounds=1, max_tokens=3)
    chats, review = states[:3], states[3]
    for chat in chats:  # each turn re-sends the history, which the cache holds
        assert chat.get_meta_info("reply_2")["cached_tokens"] > 0
    assert len(review["verdict"]) == 3
    assert all(meta["cached_tokens"] > 0 for meta in review.get_meta_info("verdict"))


@pytest.mark.parametrize("name", ["multi_turn_chat"])
def test_examples_run_as_scripts(name: str):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--max-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "assistant" in result.stdout
