"""Agent sessions beside a flood: do pins keep a tool-waiting conversation cached? (issue 55)

Agent loops (chat completions, tools on, ``tool_choice`` required, the whole conversation re-sent
each turn) wait a seeded 1-5 s "tool time" between turns, and while each waits a flood of long
unique prompts (``flood_per_wait`` of them) goes to the server beside the other loops' turns, on
a KV pool (``--max-total-tokens``) a quarter of the run's working set: the loops' conversations
plus the flood's prompts. So between two turns of a loop about a pool's worth of other KV goes
through the cache (what evicts the waiting conversation under LRU), while the conversations
waiting at once fit the pins' share of the pool (``--max-pinned-fraction``, half). Rows, each
a fresh server with the same seed:

- ``lru``: ``--tool-wait-ttl 0``, no hints (plain LRU);
- ``hints``: ``--tool-wait-ttl 0``, every agent request carries
  ``prompt_cache_retention: "in-memory"``;
- ``tool-wait``: the default ``--tool-wait-ttl``, no hints.

For the turns that follow a tool result it reports TTFT (streamed; time to the first chunk, which
the server sends with the first token) p50/p90, the p50 time to the first tool-call chunk, cached /
prompt tokens, and throughput (agent turns + flood requests per second). Two checks ride on those
servers: on ``lru``'s, a Messages request with a ``cache_control`` breakpoint (ttl 5m) and one
without, a flood of 10x the pool, then both again; on ``tool-wait``'s, two tenants
(``--api-keys-file``): ``quiet`` repeats a few prompts that fit the pool, alone and then with
``flood`` sending a pool's worth of unique prompts before each round.

    python -m benchmarks.agent_session_bench [--quick | --smoke] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from benchmarks.agent_cache_bench import tool_turn  # the agent-loop bench's lookup-tool turn
from benchmarks.common import print_table, write_json
from runtime.server import ServerProcess
from runtime.test_model import cached_test_model

SYSTEM = "You are a research agent. Look words up with the tool, one at a time."
MAX_TOKENS = 40
# Chat-template tokens around a turn's messages and its tool call's JSON, over the words counted;
# and the tools' schema in the prompt.
TURN_OVERHEAD_TOKENS = 30
TOOLS_PROMPT_TOKENS = 100
KEYS = {"agent": "key-agent", "quiet": "key-quiet", "flood": "key-flood"}
ROWS = ("lru", "hints", "tool-wait")
COLUMNS = ("ttft_p50_s", "ttft_p90_s", "hit_rate", "throughput_rps", "ttft_p50_vs_lru")


@dataclass(frozen=True)
class Sizes:
    loops: int
    turns: int
    tool_s: tuple[float, float]
    tool_result_words: int  # each tool result's length: what makes the conversation grow
    flood_words: int
    flood_per_wait: int  # unique prompts flooded while each loop waits on its tool
    quiet_prompts: int
    quiet_rounds: int


SIZES = {
    "full": Sizes(8, 3, (1.0, 5.0), 150, 300, 3, 3, 8),
    "quick": Sizes(6, 3, (0.2, 1.0), 60, 200, 2, 3, 5),
    "smoke": Sizes(5, 2, (0.05, 0.05), 40, 60, 1, 2, 2),
}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(n))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Flood:
    """A client sending long unique prompts back to back until stopped; counts what it sent."""

    def __init__(self, client: httpx.AsyncClient, model: str, words: int, seed: int, key: str):
        self.client, self.model, self.words, self.key = client, model, words, key
        self.rng = random.Random(seed)
        self.completed = 0
        self.prompt_tokens = 0

    async def send(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": _words(self.rng, self.words)}],
            "max_tokens": 4,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {self.key}"}
        reply = await self.client.post("/v1/chat/completions", json=body, headers=headers)
        self.prompt_tokens += reply.raise_for_status().json()["usage"]["prompt_tokens"]
        self.completed += 1

    async def until_tokens(self, tokens: int) -> None:
        while self.prompt_tokens < tokens:
            await self.send()


async def _turn(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]], hint: bool
) -> dict[str, Any]:
    """One streamed turn: TTFT (to the first chunk, which the server sends with the first
    token), the time to the first content or tool-call chunk (the call's name, some tokens
    later), usage, and the assistant message with its tool calls."""
    body: dict[str, Any] = {
        **tool_turn(model, messages, MAX_TOKENS),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if hint:
        body["prompt_cache_retention"] = "in-memory"
    headers = {"Authorization": f"Bearer {KEYS['agent']}"}
    start = time.perf_counter()
    ttft = first_call = None
    calls: dict[int, dict[str, str]] = {}  # index -> the call's id, name, arguments so far
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                ttft = ttft if ttft is not None else time.perf_counter() - start
                if first_call is None and (delta.get("content") or delta.get("tool_calls")):
                    first_call = time.perf_counter() - start
                for call in delta.get("tool_calls") or []:
                    held = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    function = call.get("function") or {}
                    held["id"] = call.get("id") or held["id"]
                    held["name"] = function.get("name") or held["name"]
                    held["arguments"] += function.get("arguments") or ""
    tool_calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in calls.values()
    ]
    message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
    end = time.perf_counter() - start
    return {
        "ttft_s": ttft if ttft is not None else end,
        "first_call_s": first_call if first_call is not None else end,
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "output": usage["completion_tokens"],
        "message": message,
    }


async def _agent_loop(
    client: httpx.AsyncClient, model: str, sizes: Sizes, seed: int, hint: bool, flood: Flood
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {seed}: look up these words: {_words(rng, 20)}"},
    ]
    turns = []
    for _ in range(sizes.turns):
        turn = await _turn(client, model, messages, hint)
        messages.append(turn.pop("message"))
        turns.append(turn)
        tool_time = asyncio.sleep(rng.uniform(*sizes.tool_s))
        await asyncio.gather(tool_time, *(flood.send() for _ in range(sizes.flood_per_wait)))
        call_id = messages[-1]["tool_calls"][0]["id"] if messages[-1]["tool_calls"] else "call"
        content = _words(rng, sizes.tool_result_words)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return turns


async def _agents_row(url: str, model: str, sizes: Sizes, seed: int, hint: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # The flood shares the agents' key: one tenant, so each row's eviction is its policy's.
        flood = Flood(client, model, sizes.flood_words, seed + 10_000, KEYS["agent"])
        start = time.perf_counter()
        loops = [
            _agent_loop(client, model, sizes, seed + i, hint, flood) for i in range(sizes.loops)
        ]
        sessions = await asyncio.gather(*loops)
        seconds = time.perf_counter() - start
    after_tool = [turn for turns in sessions for turn in turns[1:]]
    ttfts = [turn["ttft_s"] for turn in after_tool]
    first_calls = [turn["first_call_s"] for turn in after_tool]
    prompt = sum(turn["prompt"] for turn in after_tool)
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": _percentile(ttfts, 0.9),
        "first_call_p50_s": statistics.median(first_calls),
        "hit_rate": sum(turn["cached"] for turn in after_tool) / prompt,
        "throughput_rps": (sum(map(len, sessions)) + flood.completed) / seconds,
        "agent_turns": sum(map(len, sessions)),
        "flood_requests": flood.completed,
        "seconds": seconds,
        "measured_working_set": sum(t[-1]["prompt"] + t[-1]["output"] for t in sessions),
        "sessions": sessions,
    }


async def _messages(client: httpx.AsyncClient, model: str, prefix: str, mark: bool) -> dict:
    system: dict[str, Any] = {"type": "text", "text": prefix}
    if mark:
        system["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
    body = {
        "model": model,
        "max_tokens": 4,
        "system": [system],
        "messages": [{"role": "user", "content": "Summarize the notes."}],
    }
    reply = await client.post("/v1/messages", json=body, headers={"x-api-key": KEYS["agent"]})
    usage = reply.raise_for_status().json()["usage"]
    cached = usage["cache_read_input_tokens"]
    prompt = usage["input_tokens"] + cached + usage["cache_creation_input_tokens"]
    return {"prompt": prompt, "cached": cached}


async def _cache_control_check(url: str, model: str, sizes: Sizes, pool: int, seed: int) -> dict:
    rng = random.Random(seed + 20_000)
    marked, plain = _words(rng, sizes.flood_words), _words(rng, sizes.flood_words)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await client.post("/flush_cache", headers={"Authorization": f"Bearer {KEYS['agent']}"})
        first = await _messages(client, model, marked, True)
        await _messages(client, model, plain, False)
        flood = Flood(client, model, sizes.flood_words, seed + 30_000, KEYS["agent"])
        await flood.until_tokens(10 * pool)
        again = await _messages(client, model, marked, True)
        plain_again = await _messages(client, model, plain, False)
    return {
        "prefix_tokens": first["prompt"],
        "flood_tokens": flood.prompt_tokens,
        "cached_with_cache_control": again["cached"],
        "cached_without": plain_again["cached"],
    }


async def _quiet_rounds(
    client: httpx.AsyncClient,
    model: str,
    prompts: list[str],
    rounds: int,
    flooding: tuple[Flood, int] | None,
) -> float:
    """The quiet tenant's hit rate over ``rounds`` of ``prompts`` (the first round fills the
    cache); ``flooding``: a flood that sends the given tokens (a pool) before each round."""
    prompt = cached = 0
    for round_ in range(rounds):
        if flooding is not None:
            flood, tokens = flooding
            await flood.until_tokens(flood.prompt_tokens + tokens)
        for text in prompts:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 4,
                "temperature": 0,
            }
            headers = {"Authorization": f"Bearer {KEYS['quiet']}"}
            reply = await client.post("/v1/chat/completions", json=body, headers=headers)
            usage = reply.raise_for_status().json()["usage"]
            if round_ > 0:  # the first round fills the cache
                prompt += usage["prompt_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
    return cached / prompt if prompt else 0.0


async def _tenants_check(url: str, model: str, sizes: Sizes, pool: int, seed: int) -> dict:
    rng = random.Random(seed + 40_000)
    prompts = [_words(rng, sizes.flood_words // 2) for _ in range(sizes.quiet_prompts)]
    admin = {"Authorization": f"Bearer {KEYS['agent']}"}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await client.post("/flush_cache", headers=admin)
        solo = await _quiet_rounds(client, model, prompts, sizes.quiet_rounds, None)
        await client.post("/flush_cache", headers=admin)
        flood = Flood(client, model, sizes.flood_words, seed + 50_000, KEYS["flood"])
        shared = await _quiet_rounds(client, model, prompts, sizes.quiet_rounds, (flood, pool))
    return {
        "quiet_solo_hit_rate": solo,
        "quiet_flood_hit_rate": shared,
        "ratio": shared / solo,
        "flood_tenant_tokens": flood.prompt_tokens,
    }


def _working_set(model_path: str, sizes: Sizes) -> tuple[int, int]:
    """The run's KV tokens, estimated with the tokenizer: the loops' (each loop's last prompt,
    every tool result but the last, which is never sent, plus its last output) and the
    flood's (every prompt it sends while the loops wait)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(0)
    per_word = len(tokenizer(_words(rng, 1000))["input_ids"]) / 1000
    words = len(SYSTEM.split()) + 25 + (sizes.turns - 1) * sizes.tool_result_words
    per_turn = MAX_TOKENS + TURN_OVERHEAD_TOKENS
    per_loop = per_word * words + TOOLS_PROMPT_TOKENS + sizes.turns * per_turn
    floods = sizes.loops * sizes.turns * sizes.flood_per_wait
    flood = floods * (per_word * sizes.flood_words + TURN_OVERHEAD_TOKENS)
    return int(sizes.loops * per_loop), int(flood)


def _server(model_path: str, row: str, pool: int, keys_file: Path) -> ServerProcess:
    """The row's server, starting (enter it to wait until it is ready)."""
    flags = ["--max-total-tokens", str(pool), "--api-keys-file", str(keys_file)]
    if row != "tool-wait":
        flags += ["--tool-wait-ttl", "0"]
    return ServerProcess(model_path, *flags)


def _targets(rows: dict, cache_control: dict, tenants: dict) -> list[list[Any]]:
    lru, wait = rows["lru"], rows["tool-wait"]
    speedup = lru["ttft_p50_s"] / wait["ttft_p50_s"]
    throughput = wait["throughput_rps"] / lru["throughput_rps"]
    kept = cache_control["cached_with_cache_control"] / cache_control["prefix_tokens"]
    return [
        ["tool-wait p50 TTFT >= 3x better than lru", f"{speedup:.2f}x", speedup >= 3.0],
        ["... at >= 0.95x lru's throughput", f"{throughput:.2f}x", throughput >= 0.95],
        ["cache_control prefix hits after a 10x-pool flood", f"{kept:.0%}", kept >= 0.9],
        ["quiet tenant keeps >= 80% of its solo hit rate", f"{tenants['ratio']:.0%}",
         tenants["ratio"] >= 0.8],
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short tool times, fewer loops")
    mode.add_argument("--smoke", action="store_true", help="the smallest run (tests)")
    parser.add_argument("--model-path", default=None, help="default: the tiny test model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON results path")
    args = parser.parse_args()
    sizes = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    model_path = args.model_path or str(cached_test_model("tiny", "llama", chat_template="chatml"))
    loops_tokens, flood_tokens = _working_set(model_path, sizes)
    working_set = loops_tokens + flood_tokens
    pool = working_set // 4
    print(f"working set ~{working_set} tokens: {sizes.loops} loops x {sizes.turns} turns "
          f"~{loops_tokens}, flood ~{flood_tokens}; pool --max-total-tokens {pool}")  # fmt: skip
    keys_file = Path(tempfile.mkdtemp(prefix="arbor-bench-")) / "keys"
    keys_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    rows: dict[str, Any] = {}
    with ExitStack() as stopping:
        # --smoke starts all three servers at once, to keep the test short.
        early: dict[str, ServerProcess] = {}
        for name in ROWS if args.smoke else ():
            early[name] = _server(model_path, name, pool, keys_file)
            stopping.callback(early[name].stop)
        for name in ROWS:
            with early.get(name) or _server(model_path, name, pool, keys_file) as server:
                headers = {"Authorization": f"Bearer {KEYS['agent']}"}
                models = httpx.get(f"{server.url}/v1/models", headers=headers).json()
                model = models["data"][0]["id"]
                rows[name] = asyncio.run(
                    _agents_row(server.url, model, sizes, args.seed, name == "hints")
                )
                if name == "lru":
                    cache_control = asyncio.run(
                        _cache_control_check(server.url, model, sizes, pool, args.seed)
                    )
                if name == "tool-wait":
                    tenants = asyncio.run(_tenants_check(server.url, model, sizes, pool, args.seed))
    for row in rows.values():
        row["ttft_p50_vs_lru"] = row["ttft_p50_s"] / rows["lru"]["ttft_p50_s"]
    print_table(
        [
            "row",
            "TTFT p50 s",
            "TTFT p90 s",
            "hit rate",
            "req/s",
            "p50 vs lru",
            "call p50 s",
            "turns",
            "flood",
        ],
        [
            [
                name,
                *(r[c] for c in COLUMNS),
                r["first_call_p50_s"],
                r["agent_turns"],
                r["flood_requests"],
            ]
            for name, r in rows.items()
        ],
    )
    print()
    print_table(["check", "value"], [[k, v] for k, v in {**cache_control, **tenants}.items()])
    print()
    targets = _targets(rows, cache_control, tenants)
    print_table(["target", "result", "pass"], targets)
    payload = {
        "sizes": asdict(sizes),
        "seed": args.seed,
        "working_set_tokens": working_set,
        "loops_tokens": loops_tokens,
        "max_total_tokens": pool,
        "rows": rows,
        "cache_control": cache_control,
        "tenants": tenants,
        "targets": [{"target": t, "result": r, "pass": p} for t, r, p in targets],
    }
    mode_name = "smoke" if args.smoke else "quick" if args.quick else "full"
    write_json(f"agent_session_bench-{mode_name}", payload, args.out)


if __name__ == "__main__":
    main()
