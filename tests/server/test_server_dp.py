"""``arbor serve --dp 2``: two replicas on a local Ray instance behind the cache-aware router.

One routed server for the module (Ray and two model loads take ~15 s on two cores); its outputs
are compared with the single-engine session server's. The last test kills a replica.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import frontend_lang as fl
from runtime.server import ServerProcess
from tests.server.server_process import POOL, pid_alive, sse_payloads
from tests.tool_fixtures import time_tool

pytest.importorskip("ray")

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def routed(tiny_model_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tiny_model_path, *POOL, "--dp", "2", startup_timeout_s=240.0, stop_timeout_s=60.0
    )
    pids: list[int] = []
    try:
        process.wait_ready()
        pids = [r["pid"] for r in _info(process)["replicas"]]
        yield process
    finally:
        process.stop()
    # Stopping the server stops its replicas (and the Ray instance it started).
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids)


def _info(server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(f"{server.url}/get_server_info", timeout=30)
    response.raise_for_status()
    return response.json()


def _generate(server: ServerProcess, text: str, **params: Any) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {**GREEDY, **params}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def test_greedy_outputs_equal_a_single_engine(routed: ServerProcess, server: ServerProcess) -> None:
    for prompt in PROMPTS:
        assert _generate(routed, prompt)["output_ids"] == _generate(server, prompt)["output_ids"]
    info = _info(routed)
    assert info["dp_size"] == 2
    assert [r["replica"] for r in info["replicas"]] == [0, 1]
    assert all(r["alive"] for r in info["replicas"])
    assert sum(info["router"]["routed"]) >= len(PROMPTS)
    # Summed over replicas, as the single server counts them.
    assert info["requests_finished"] == sum(r["requests_finished"] for r in info["replicas"])


def test_openai_chat_streaming(routed: ServerProcess, server: ServerProcess) -> None:
    model = httpx.get(f"{routed.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 10,
        "temperature": 0,
    }
    with httpx.stream(
        "POST", f"{routed.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        chunks = list(sse_payloads(response.iter_lines()))
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    single = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert streamed == single["choices"][0]["message"]["content"]


@fl.function
def _branches(s: Any, topic: str) -> None:
    s += f"A long shared introduction about {topic}, repeated so that it is worth caching. " * 4
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += f"Idea {i + 1}:" + fl.gen("idea", max_tokens=6, temperature=0)
    forks.join()


def test_dsl_fork_program_lands_on_the_replica_holding_its_prefix(
    routed: ServerProcess, server: ServerProcess
) -> None:
    decisions = lambda: _info(routed)["router"]["decisions"]  # noqa: E731
    before = decisions()
    ours = fl.RuntimeEndpoint(routed.url)
    single = fl.RuntimeEndpoint(server.url)
    try:
        compiled = _branches.run(topic="rivers", backend=ours)
        after_compiled = decisions()
        interpreted = _branches.run(topic="rivers", backend=ours, compile=False)
        want = _branches.run(topic="rivers", backend=single)
    finally:
        ours.shutdown()
        single.shutdown()
    assert compiled["idea"] == interpreted["idea"] == want["idea"]
    # Compiled: the program's steps (fork prefill, three branches) stay on its replica.
    assert after_compiled.get("program", 0) - before.get("program", 0) >= 3
    # Interpreted: the fork's prefix request went to one replica; the branches followed it.
    assert decisions().get("cache_hit", 0) - after_compiled.get("cache_hit", 0) >= 3


def test_the_router_and_the_replicas_keep_cache_salts_apart(routed: ServerProcess) -> None:
    decisions = lambda: _info(routed)["router"]["decisions"]  # noqa: E731
    text = "A prompt two tenants share, long enough to be worth routing by its prefix. " * 4
    body = {"text": text, "sampling_params": {**GREEDY, "max_new_tokens": 1}}

    def cached(salt: str) -> int:
        response = httpx.post(
            f"{routed.url}/generate", json={**body, "cache_salt": salt}, timeout=60
        )
        response.raise_for_status()
        return int(response.json()["meta_info"]["cached_tokens"])

    assert cached("dp-tenant-a") == 0
    before = decisions()
    assert cached("dp-tenant-b") == 0  # routed as a miss, computed from scratch
    after = decisions()
    assert after.get("cache_miss", 0) == before.get("cache_miss", 0) + 1
    assert cached("dp-tenant-a") > 0  # back to the replica holding its own prefix
    assert decisions().get("cache_hit", 0) == after.get("cache_hit", 0) + 1


def test_a_tool_calling_turn_is_pinned_on_the_replica_that_ran_it(routed: ServerProcess) -> None:
    """The tool-wait pin, which the server asks for after reading the calls (``PinPrefix``),
    reaches the replica whose cache holds the turn."""
    model = httpx.get(f"{routed.url}/v1/models", timeout=30).json()["data"][0]["id"]
    tools = [time_tool({"type": "string", "maxLength": 4})]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What time is it in Lima, on a routed server?"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 160,
        "temperature": 0,
    }
    before = [replica["num_kv_pins"] for replica in _info(routed)["replicas"]]
    reply = httpx.post(f"{routed.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    total = reply["usage"]["total_tokens"]
    deadline = time.monotonic() + 10  # the pin follows the reply by a message
    while time.monotonic() < deadline:
        replicas = _info(routed)["replicas"]
        grown = [r for r, was in zip(replicas, before, strict=True) if r["num_kv_pins"] > was]
        if grown:
            break
        time.sleep(0.2)
    assert len(grown) == 1 and grown[0]["kv_pinned_tokens"] >= total - 2


def test_a_prompt_cache_key_keeps_its_chats_on_one_replica(routed: ServerProcess) -> None:
    """OpenAI's prompt_cache_key reaches the router: chats with one key and no common prefix
    (which the router would spread) all go where the first went."""
    model = httpx.get(f"{routed.url}/v1/models", timeout=30).json()["data"][0]["id"]
    info = _info(routed)
    routed_before, decided_before = info["router"]["routed"], info["router"]["decisions"]
    for i in range(6):
        words = " ".join(f"w{i}x{j}" for j in range(60))
        body = {
            "model": model,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 1,
            "prompt_cache_key": "dp-session",
        }
        httpx.post(f"{routed.url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
    info = _info(routed)
    spread = [a - b for a, b in zip(info["router"]["routed"], routed_before, strict=True)]
    assert sorted(spread) == [0, 6]
    keyed = info["router"]["decisions"].get("routing_key", 0)
    assert keyed == decided_before.get("routing_key", 0) + 5


def test_metrics_report_each_replica_and_the_router(routed: ServerProcess) -> None:
    text = httpx.get(f"{routed.url}/metrics", timeout=30).text
    for replica in ("0", "1"):
        assert f'arbor_replica_alive{{replica="{replica}"}} 1.0' in text
        assert f'arbor_replica_cache_hit_rate{{replica="{replica}"}}' in text
    assert 'arbor_router_decisions_total{decision="cache_hit"}' in text
    # The gateway gauges and prefix-cache counters are the replicas' sums (earlier tests ran
    # cached requests on both replicas).
    info = _info(routed)
    rows = info["replicas"]
    assert all(0 <= row["kv_cache_utilization"] <= 1 for row in rows)
    assert any(row["kv_cache_utilization"] > 0 for row in rows)
    for key in ("prefix_cache_queries_tokens", "prefix_cache_hits_tokens"):
        assert info[key] == sum(row[key] for row in rows) > 0
    free, pool = info["kv_free_tokens"], info["max_total_tokens"]
    assert info["kv_cache_utilization"] == pytest.approx(1 - free / pool)
    assert f"arbor_prefix_cache_hits_tokens_total {float(info['prefix_cache_hits_tokens'])}" in text
    assert 'arbor_replica_kv_cache_utilization{replica="1"}' in text


def test_a_killed_replica_is_routed_around_and_comes_back(routed: ServerProcess) -> None:
    victim = _info(routed)["replicas"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    # Every request is answered: by the survivor, or retried there if it went to the victim.
    for prompt in PROMPTS * 2:
        assert _generate(routed, prompt, max_new_tokens=4)["meta_info"]["completion_tokens"] == 4
    deadline = time.monotonic() + 120
    row = victim
    while time.monotonic() < deadline:
        row = _info(routed)["replicas"][0]
        if row["alive"] and row["pid"] != victim["pid"]:
            break
        time.sleep(1.0)
    assert row["alive"] and row["restarts"] >= 1 and row["pid"] != victim["pid"]
    assert httpx.get(f"{routed.url}/health", timeout=10).status_code == 200
    for prompt in PROMPTS:
        _generate(routed, prompt, max_new_tokens=2)


def test_dp_and_tp_combine(tiny_model_path: Path, server: ServerProcess) -> None:
    """Two replicas of two tensor-parallel ranks each: the same greedy tokens."""
    with ServerProcess(
        tiny_model_path, *POOL, "--dp", "2", "--tp", "2", startup_timeout_s=240.0,
        stop_timeout_s=60.0,
    ) as both:  # fmt: skip
        info = _info(both)
        assert info["tp_size"] == 2 and len(info["replicas"]) == 2
        for prompt in PROMPTS[:2]:
            assert _generate(both, prompt)["output_ids"] == _generate(server, prompt)["output_ids"]
