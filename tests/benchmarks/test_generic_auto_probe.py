"""generic_auto_probe's rules, on made-up branch logprobs (no model)."""

from __future__ import annotations

from benchmarks.generic_auto_probe import branch_texts, decisions


def _row(task: str, item: str, call: list[float], answer: list[float]) -> dict[str, object]:
    return {"task": task, "id": item, "call": call, "answer": answer}


def test_branch_texts_end_where_the_model_chooses():
    tool = {"name": "get_weather", "parameters": {"properties": {"city": {}, "unit": {}}}}
    texts = branch_texts(tool)
    assert texts["call"] == '{"tool_call": {"name": "get_weather", "arguments": {"city": "'
    assert texts["answer"] == '{"response": "'


def test_each_rule_counts_the_calls_it_would_make():
    """Index 1 is the key token (after the shared opening); a rule calls when the call's
    score beats the answer's, by more than the content-free requests' for calibrated rules."""
    rows = [
        # key favours the call, the whole call text costs more, the mean favours the call
        _row("tool_weather", "w0", [-1.0, -0.5, -3.0, -0.1], [-1.0, -1.5]),
        # key favours the answer, everything else too
        _row("tool_weather", "w1", [-1.0, -4.0, -9.0, -0.1], [-1.0, -1.0]),
        _row("no_call", "n0", [-1.0, -0.2, -0.1, -0.1], [-1.0, -3.0]),
        _row("content-free", "cf", [-1.0, -0.5, -1.0, -1.0], [-1.0, -2.0]),
    ]
    table = {row[0]: row[1:] for row in decisions(rows)}
    assert table["key token"] == ["1/2", "1/1", 0.0]
    assert table["whole forced text, summed"] == ["0/2", "1/1", 0.0]
    assert table["whole forced text, per-token mean"] == ["1/2", "1/1", 0.0]
    # content-free key log-odds: -0.5 - -2.0 = 1.5; w0's is 1.0, n0's 2.8
    assert table["key token, calibrated"] == ["0/2", "1/1", 1.5]


class _Template:
    """A tokenizer whose chat template writes each turn as ``role: content``."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # noqa: ANN001
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def test_prompt_after_a_result_holds_the_call_and_its_result():
    """The agent loop's second request: the call as the envelope writes it, then its result."""
    from benchmarks.generic_auto_probe import prompt_text
    from benchmarks.quality_tasks import load_tasks

    task = load_tasks(["tool_weather"])[0]
    first = prompt_text(_Template(), task, "Weather in Oslo?")
    after = prompt_text(_Template(), task, "Weather in Oslo?", city="Oslo")
    assert after.startswith(first.removesuffix("\nassistant:"))
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    assert f"assistant: {call}" in after
    assert 'Result of tool get_weather: {"city": "Oslo"' in after
