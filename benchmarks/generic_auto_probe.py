"""Why the generic format's ``tool_choice: auto`` calls or answers: the branch probabilities.

Under auto the reply envelope's first key decides (``runtime.chat.generic_tools``): the
grammar admits ``"tool_call"`` or ``"response"`` and greedy decoding takes the likelier token.
For every item of quality_bench's frozen ``tool_weather`` and ``no_call`` sets, and for
content-free requests (``N/A``, empty, ``[MASK]`` as the user turn), this renders the prompt the
server renders (the generic system text, the chat template) and reads, with prompt logprobs,
the log-probability of each branch's forced text after it::

    call:    {"tool_call": {"name": "<tool>", "arguments": {"<first property>": "
    answer:  {"response": "

It then counts, per task, the calls each decision rule makes (ideal: every ``tool_weather``
item, no ``no_call`` item): the key token (the shipped greedy choice), each branch's whole
forced text summed and per-token mean, and each calibrated against the content-free requests
(Zhao et al. 2021); and, for each weather question, the key token in the turn after the model
called the tool and got its result (an agent loop's second request: the right move is to
answer). Scored with the compact opening ``{"``; the aligned layout's whitespace before the key
is not followed, so the counts screen rules and prompts, they do not replace quality_bench
(docs/benchmarks.md, "the call-or-answer decision examined").

    python -m benchmarks.generic_auto_probe [--model-path PATH]   (default: the built-in model)
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from benchmarks.common import print_table, write_json
from benchmarks.quality_tasks import Task, load_tasks
from runtime.chat.generic_tools import ReplyEnvelope, generic_messages
from runtime.engine import Engine
from runtime.model_files import builtin_model_path

CONTENT_FREE = ("N/A", "", "[MASK]")
AFTER = "tool_weather, after the result"  # the turn after the call and its result
TASKS = ("tool_weather", "no_call")


def branch_texts(tool: dict[str, Any]) -> dict[str, str]:
    """Each branch's text up to the first token the model chooses freely."""
    first = next(iter(tool["parameters"]["properties"]))
    name = json.dumps(tool["name"])
    return {
        "call": f'{{"tool_call": {{"name": {name}, "arguments": {{"{first}": "',
        "answer": '{"response": "',
    }


def prompt_text(tokenizer: Any, task: Task, user: str, city: str | None = None) -> str:
    """The prompt the server renders for ``user`` under auto with ``task``'s tool; with
    ``city``, for the turn after the model called the tool for that city and got its result
    (an agent loop's second request)."""
    tools = [{"type": "function", "function": task.tool}]
    envelope = ReplyEnvelope(parallel=False)
    conversation: list[dict[str, Any]] = [{"role": "user", "content": user}]
    if city is not None:
        assert task.tool is not None
        call = {"name": task.tool["name"], "arguments": json.dumps({"city": city})}
        result = {"city": city, "temperature_c": 21, "conditions": "sunny"}
        conversation += [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "function": call}]},
            {"role": "tool", "tool_call_id": "c0", "content": json.dumps(result)},
        ]
    messages = generic_messages(conversation, tools, envelope=envelope)
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def branch_logprobs(engine: Engine, prompts: list[tuple[str, str]]) -> list[list[float]]:
    """For each (prompt text, continuation) the continuation's per-token logprobs after the
    prompt, greedy, in one batch."""
    tokenizer = engine.tokenizer_manager.tokenizer
    inputs: list[list[int]] = []
    lengths: list[int] = []
    for prompt, continuation in prompts:
        ids = tokenizer.encode(prompt + continuation, add_special_tokens=False)
        inputs.append(ids)
        lengths.append(len(ids) - len(tokenizer.encode(prompt, add_special_tokens=False)))
    start = min(len(ids) - n for ids, n in zip(inputs, lengths, strict=True))
    results = engine.generate(
        input_ids=inputs,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=start,
    )
    return [
        [entry[0] for entry in result["meta_info"]["input_token_logprobs"]][-n:]
        for result, n in zip(results, lengths, strict=True)
    ]


def decisions(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Calls per task under each rule (a call when its score beats the answer's)."""
    key = {r["id"]: r["call"][1] - r["answer"][1] for r in rows}  # after the shared '{"'
    whole = {r["id"]: sum(r["call"]) - sum(r["answer"]) for r in rows}
    mean = {r["id"]: statistics.mean(r["call"]) - statistics.mean(r["answer"]) for r in rows}
    free = [r["id"] for r in rows if r["task"] == "content-free"]
    rules = {
        "key token": (key, 0.0),
        "whole forced text, summed": (whole, 0.0),
        "whole forced text, per-token mean": (mean, 0.0),
        "key token, calibrated": (key, statistics.mean(key[i] for i in free)),
        "whole text summed, calibrated": (whole, statistics.mean(whole[i] for i in free)),
    }
    table = []
    for name, (score, baseline) in rules.items():
        counts = []
        for task in TASKS:
            ids = [r["id"] for r in rows if r["task"] == task]
            counts.append(f"{sum(score[i] > baseline for i in ids)}/{len(ids)}")
        table.append([name, *counts, round(baseline, 2)])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="generic_auto_probe", description=__doc__)
    parser.add_argument("--model-path", help="GGUF file or HF folder (default: built-in model)")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    tasks = {task.name: task for task in load_tasks(list(TASKS))}
    engine = Engine(args.model_path or builtin_model_path(), max_total_tokens=32768)
    try:
        tokenizer = engine.tokenizer_manager.tokenizer
        cases = [
            (name, item.id, tasks[name], tasks[name].user_message(item))
            for name in TASKS
            for item in tasks[name].items
        ]
        cases += [("content-free", repr(u), tasks["no_call"], u) for u in CONTENT_FREE]
        weather = tasks["tool_weather"]
        # Ids of their own: the rules' scores are keyed by id.
        after = {f"after-{item.id}": str(item.answer["city"]) for item in weather.items}
        cases += [
            (AFTER, f"after-{item.id}", weather, weather.user_message(item))
            for item in weather.items
        ]
        prompts = []
        for name, item_id, task, user in cases:
            text = prompt_text(tokenizer, task, user, after[item_id] if name == AFTER else None)
            assert task.tool is not None  # both tasks offer a tool
            prompts += [(text, branch) for branch in branch_texts(task.tool).values()]
        scored = branch_logprobs(engine, prompts)
    finally:
        engine.shutdown()
    rows: list[dict[str, Any]] = [
        {"task": name, "id": item_id, "call": scored[2 * i], "answer": scored[2 * i + 1]}
        for i, (name, item_id, _, _) in enumerate(cases)
    ]
    table = decisions(rows)
    print_table(["rule", "tool_weather calls", "no_call calls", "threshold"], table)
    for group in (*TASKS, "content-free", AFTER):
        key = [r["call"][1] - r["answer"][1] for r in rows if r["task"] == group]
        calls = sum(k > 0 for k in key)
        print(
            f"{group}: mean key log-odds (call - answer) {statistics.mean(key):+.2f}, "
            f"key token calls {calls}/{len(key)}"
        )
    write_json("generic_auto_probe", {"rules": table, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
