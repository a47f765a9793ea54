"""Prefix reuse across the turns of a tool-using agent conversation.

A 5-turn tool loop against ``arbor serve`` (tiny test model, greedy): each turn the model must
call a tool (``tool_choice`` required, one call, bounded arguments), the tool's result is
appended, and the next turn asks again. Three ways a client can carry the conversation:

- ``chat``: chat completions with the whole history re-sent each turn (what most frameworks do);
- ``responses-items``: the Responses API with the whole history re-sent as input items
  (the Agents SDK's default);
- ``responses-previous``: the Responses API with ``previous_response_id`` and only the new
  items.

Per turn it reports prompt tokens, cached tokens and the *reusable* tokens (the previous turn's
prompt and output: everything up to the new turn) and, over turns 2-5, the hit rate
cached / prompt and cached / reusable — 100% of the reusable tokens is the goal.

    python -m benchmarks.agent_cache_bench [--turns 5] [--chat-template chatml]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from benchmarks.common import print_table, write_json
from runtime.server import ServerProcess
from runtime.test_model import cached_test_model

TOOL = {
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 10}},
        "required": ["word"],
        "additionalProperties": False,
    },
}
SYSTEM = "You are a research agent. Look words up with the tool, one at a time."
MAX_TOKENS = 60


def tool_turn(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """A chat completion body for an agent turn that must call ``TOOL`` (once), greedy."""
    return {
        "model": model,
        "messages": messages,
        "tools": [{"type": "function", "function": TOOL}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _chat_loop(client: httpx.Client, model: str, turns: int) -> list[dict[str, int]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look up five words."},
    ]
    rows = []
    for _ in range(turns):
        body = tool_turn(model, messages, MAX_TOKENS)
        reply = client.post("/v1/chat/completions", json=body).raise_for_status().json()
        usage = reply["usage"]
        rows.append(
            {
                "prompt": usage["prompt_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"],
                "output": usage["completion_tokens"],
            }
        )
        message = reply["choices"][0]["message"]
        messages.append(message)
        call = message["tool_calls"][0]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found it"})
    return rows


def _responses_loop(
    client: httpx.Client, model: str, turns: int, previous: bool
) -> list[dict[str, int]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "Look up five words."}]
    new_items = list(items)
    previous_id = None
    rows = []
    for _ in range(turns):
        body = {
            "model": model,
            "instructions": SYSTEM,
            "input": new_items if previous else items,
            "tools": [{"type": "function", **TOOL}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if previous and previous_id:
            body["previous_response_id"] = previous_id
        reply = client.post("/v1/responses", json=body).raise_for_status().json()
        usage = reply["usage"]
        rows.append(
            {
                "prompt": usage["input_tokens"],
                "cached": usage["input_tokens_details"]["cached_tokens"],
                "output": usage["output_tokens"],
            }
        )
        previous_id = reply["id"]
        call = next(item for item in reply["output"] if item["type"] == "function_call")
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "found it"}
        items += [
            {k: call[k] for k in ("type", "call_id", "name", "arguments")},
            result,
        ]
        new_items = [result]
    return rows


def _summary(rows: list[dict[str, int]]) -> dict[str, float]:
    later = list(zip(rows, rows[1:], strict=False))
    prompt = sum(turn["prompt"] for _, turn in later)
    cached = sum(turn["cached"] for _, turn in later)
    reusable = sum(before["prompt"] + before["output"] - 1 for before, _ in later)
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "reusable_hit_rate": min(1.0, cached / reusable) if reusable else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--chat-template", default="chatml", help="test model template")
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()
    path = cached_test_model(args.preset, "llama", chat_template=args.chat_template)
    results: dict[str, Any] = {}
    with ServerProcess(path, "--max-total-tokens", "16384") as server:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            loops = {
                "chat": lambda: _chat_loop(client, model, args.turns),
                "responses-items": lambda: _responses_loop(client, model, args.turns, False),
                "responses-previous": lambda: _responses_loop(client, model, args.turns, True),
            }
            for name, loop in loops.items():
                client.post("/flush_cache")
                rows = loop()
                results[name] = {"turns": rows, **_summary(rows)}
    table = []
    for name, result in results.items():
        for i, turn in enumerate(result["turns"]):
            table.append([name, i + 1, turn["prompt"], turn["cached"], turn["output"], "", ""])
        table.append([name, "2-5", "", "", "", result["hit_rate"], result["reusable_hit_rate"]])
    print_table(["client", "turn", "prompt", "cached", "output", "hit rate", "of reusable"], table)
    payload = {"preset": args.preset, "chat_template": args.chat_template, "results": results}
    write_json(f"agent_cache_bench-{args.chat_template}", payload, args.out)
    print(json.dumps({k: v["reusable_hit_rate"] for k, v in results.items()}))


if __name__ == "__main__":
    main()
