"""Tenants on one server (issue 41): ``cache_salt`` on every API keeps their prefix caches
apart — no cached tokens, no warm time to first token, no shared node in the cache tree — a
bad salt is a 400 naming it, and ``--admin-api-key`` guards what shows cached text."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.scheduler.cache_view import salt_label
from runtime.server import ServerProcess
from tests.runtime.helpers import random_prompts
from tests.server.server_process import ADMIN_KEY, POOL, sse_payloads

pytestmark = pytest.mark.timeout(300)

API_KEY = "tenant-shared-key"
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model_path, *POOL, "--admin-api-key", ADMIN_KEY, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def model(tenant: httpx.Client) -> str:
    return str(tenant.get("/v1/models").json()["data"][0]["id"])


def _bodies(model: str, text: str) -> dict[str, dict[str, Any]]:
    """A one-token request of ``text`` on each API that takes a salt."""
    return {
        "/generate": {"text": text, "sampling_params": ONE_TOKEN},
        "/v1/completions": {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0},
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 1,
            "temperature": 0,
        },
        "/v1/responses": {"model": model, "input": text, "max_output_tokens": 1},
    }


def _cached_tokens(path: str, answer: dict[str, Any]) -> int:
    if path == "/generate":
        return int(answer["meta_info"]["cached_tokens"])
    if path == "/v1/responses":
        return int(answer["usage"]["input_tokens_details"]["cached_tokens"])
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---- cache_salt --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "salt", ["", "x" * 257, "tab\tsalt", "ténant", "\ud800", 7, ["a"]], ids=repr
)
def test_a_bad_salt_is_a_400_naming_it_on_every_api(
    tenant: httpx.Client, model: str, salt: object
) -> None:
    bodies = _bodies(model, "A request with a bad salt.")
    bodies["/program"] = {"branches": {"": [{"type": "text", "text": "x"}]}}
    for path, body in bodies.items():
        raw = json.dumps({**body, "cache_salt": salt})  # a lone surrogate stays escaped
        response = tenant.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "cache_salt" and "cache_salt" in error["message"], (path, error)
    ok = tenant.post("/generate", json={**bodies["/generate"], "cache_salt": "~ printable " * 21})
    assert ok.status_code == 200, ok.text  # 252 characters: the server serves on


def test_cached_tokens_are_zero_across_salts_on_every_api(tenant: httpx.Client, model: str) -> None:
    text = "Every tenant sends this same long shared system prompt about radix caches. " * 6
    for path, body in _bodies(model, text).items():

        def cached(salt: str | None, path: str = path, body: dict[str, Any] = body) -> int:
            salted = body if salt is None else {**body, "cache_salt": salt}
            response = tenant.post(path, json=salted)
            assert response.status_code == 200, (path, response.text)
            return _cached_tokens(path, response.json())

        first = cached(f"{path}-a")
        assert cached(f"{path}-b") == 0, path  # the other tenant: cold
        assert cached(f"{path}-a") > first and cached(f"{path}-b") > 0, path  # each: warm
        assert cached(f"{path}-c") == 0, path


def test_a_program_runs_under_the_salt_it_started_with(tenant: httpx.Client) -> None:
    text = "A compiled program's prefix, long enough to fill a few pages of the cache. " * 4
    segment = {
        "cache_salt": "tenant-a",
        "branches": {"": [{"type": "text", "text": text}, {"type": "gen", "name": "g",
                                                           "sampling_params": ONE_TOKEN}]},
    }  # fmt: skip
    first = tenant.post("/program", json=segment)
    assert first.status_code == 200, first.text
    segment["program_id"] = program_id = first.json()["program_id"]
    # Under another salt, or none, the program is unknown: the 404 of an id never made.
    never = tenant.post("/program", json={**segment, "program_id": "never-made"}).json()
    for salt in ("tenant-b", None):
        other = tenant.post("/program", json={**segment, "cache_salt": salt})
        assert other.status_code == 404, other.text
        assert other.json()["error"]["message"] == never["error"]["message"].replace(
            "never-made", program_id
        )
    for salt, status in (("tenant-b", 404), ("tenant-a", 200)):
        ended = tenant.delete(f"/program/{program_id}", params={"cache_salt": salt})
        assert ended.status_code == status, (salt, ended.text)
    for salt, cached in (("tenant-b", 0), ("tenant-a", 1)):
        answer = tenant.post("/generate", json={"text": text, "sampling_params": ONE_TOKEN,
                                                "cache_salt": salt}).json()  # fmt: skip
        assert (answer["meta_info"]["cached_tokens"] > 0) == bool(cached), salt


def _first_token_s(tenant: httpx.Client, ids: list[int], salt: str) -> tuple[float, int]:
    """Seconds from sending a streamed one-token request to its first event, and its
    cached_tokens."""
    body = {"input_ids": ids, "sampling_params": ONE_TOKEN, "stream": True, "cache_salt": salt}
    started = time.perf_counter()
    with tenant.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
        first = next(events)
        elapsed = time.perf_counter() - started
        for _ in events:  # read the stream to its end
            pass
    return elapsed, int(first["meta_info"]["cached_tokens"])


def test_time_to_first_token_across_salts_is_the_cold_one(tenant: httpx.Client) -> None:
    """The timing attack: a victim sends a long prompt, an attacker sends the same prefix under
    another salt and times its first token. The attacker must see the time of a prompt nobody
    sent (cold), never that of a cached one (warm). Each trial uses a fresh 2,048-token prefix
    and alternates which of the attacker's and the victim's repeats goes first."""
    trials = 10
    cold, warm, cross = [], [], []
    for i, prefix in enumerate(random_prompts([2048] * trials, seed=4100)):
        t_cold, cached = _first_token_s(tenant, prefix + [11], "victim")
        assert cached == 0
        cold.append(t_cold)
        repeats = [("attacker", prefix + [12]), ("victim", prefix + [13])]
        for salt, ids in repeats if i % 2 else repeats[::-1]:
            elapsed, cached = _first_token_s(tenant, ids, salt)
            if salt == "attacker":
                assert cached == 0  # exact: the attacker's request computed every token
                cross.append(elapsed)
            else:
                assert cached == len(prefix)
                warm.append(elapsed)
    typical_warm = statistics.median(warm)
    summary = f"cold {sorted(cold)}\nwarm {sorted(warm)}\ncross-salt {sorted(cross)}"
    # Computing 2,048 tokens takes far longer than computing one: over HTTP on the loaded 2-core
    # machine, medians of 178 ms cold, 178 ms cross-salt and 18 ms warm (20 trials). Broken
    # isolation makes the ratio about 1; these bounds leave a noisy machine a factor of 3.
    assert statistics.median(cross) > 3 * typical_warm, summary
    assert min(cross) > 1.5 * typical_warm, summary  # no single repeat looks cached
    assert statistics.median(cross) > 0.5 * statistics.median(cold), summary


# ---- the admin key ------------------------------------------------------------------------------

ADMIN_ROUTES = [
    ("GET", "/cache_tree"),
    ("GET", "/cache_tree/prefix?node=1"),
    ("GET", "/dashboard"),
    ("GET", "/dashboard/static/tree.js"),
    ("POST", "/flush_cache"),
    ("GET", "/flush_cache"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_take_the_admin_key_only(
    server: ServerProcess, tenant: httpx.Client, admin: httpx.Client, method: str, path: str
) -> None:
    refused = tenant.request(method, path)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "admin_key_required"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        anonymous = httpx.request(method, server.url + path, headers=headers, timeout=30)
        assert anonymous.status_code == 401, anonymous.text
    assert admin.request(method, path).status_code in (200, 404)  # 404: node 1 is not shown
    if method == "GET" and not path.startswith("/flush_cache"):  # a browser's Basic login
        assert httpx.get(server.url + path, auth=("any", API_KEY)).status_code == 403
        assert httpx.get(server.url + path, auth=("any", ADMIN_KEY)).status_code in (200, 404)


def test_the_admin_key_opens_the_ordinary_routes_and_open_ones_stay_open(
    server: ServerProcess, admin: httpx.Client
) -> None:
    body = {"text": "hi", "sampling_params": ONE_TOKEN}
    assert admin.post("/generate", json=body).status_code == 200
    assert httpx.post(f"{server.url}/generate", json=body).status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200


def test_server_info_shows_process_details_to_the_admin_only(
    tenant: httpx.Client, admin: httpx.Client
) -> None:
    mine = tenant.get("/get_server_info")
    full = admin.get("/get_server_info")
    assert mine.status_code == full.status_code == 200
    internals = {"server_pid", "scheduler_pid", "detokenizer_pid", "ipc_dir", "tp_worker_pids"}
    assert internals <= set(full.json()) and not internals & set(mine.json())
    assert {"kv_usage", "num_running_reqs", "max_total_tokens"} <= set(mine.json())
    for answer in (mine, full):  # neither key is reported
        assert API_KEY not in answer.text and ADMIN_KEY not in answer.text
        assert "api_key" not in answer.json() and "admin_api_key" not in answer.json()


def test_server_info_shows_paths_and_addresses_to_the_admin_only(
    tenant: httpx.Client, admin: httpx.Client, tiny_model_path: Path
) -> None:
    mine = tenant.get("/get_server_info")
    full = admin.get("/get_server_info")
    where = {"model_path", "kv_disk_path", "host", "otlp_traces_endpoint", "tokenizer_path"}
    assert where <= set(full.json()) and not where & set(mine.json())
    assert str(tiny_model_path) in full.text and str(tiny_model_path) not in mine.text


def test_metrics_show_no_prompt_text_nor_salt(server: ServerProcess, tenant: httpx.Client) -> None:
    secret = "Quokkazebra confidential roadmap"
    salt = "salt-of-tenant-q"
    answer = tenant.post(
        "/generate", json={"text": secret, "sampling_params": ONE_TOKEN, "cache_salt": salt}
    )
    assert answer.status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "arbor_requests_total" in metrics
    for word in ("Quokkazebra", "confidential", "roadmap", salt, str(salt_label(salt))[5:]):
        assert word not in metrics


def test_the_cache_tree_keeps_each_salt_under_its_own_root(
    tenant: httpx.Client, admin: httpx.Client
) -> None:
    assert admin.post("/flush_cache").status_code == 200
    shared = "Same words from every tenant about their caches. " * 3
    # Words too rare to be one token of the test tokenizer: no output token spells them.
    words = {"tenant-a": "Xylophonist", "tenant-b": "Quetzalcoatl", None: "Zwitterionic"}
    prompts = {salt: f"{shared}{word} {word}" for salt, word in words.items()}
    for salt, text in prompts.items():
        body = {"text": text, "sampling_params": ONE_TOKEN, "rid": f"tree-{words[salt]}"}
        salted = body if salt is None else {**body, "cache_salt": salt}
        assert tenant.post("/generate", json=salted).status_code == 200
    raw = admin.get("/cache_tree", params={"max_nodes": 500})
    assert "tenant-a" not in raw.text and "tenant-b" not in raw.text  # labels, not salts
    tree = raw.json()
    nodes = {n["id"]: n for n in tree["nodes"]}
    roots = {n["namespace"]: n["id"] for n in tree["nodes"] if n["parent"] is None}
    labels = {salt: salt_label(salt) for salt in prompts}
    assert set(roots) == set(labels.values())

    def root_of(node_id: int) -> int:
        while nodes[node_id]["parent"] is not None:
            node_id = nodes[node_id]["parent"]
        return node_id

    for node in tree["nodes"]:
        if node["parent"] is None:
            continue
        (salt,) = [s for s, label in labels.items() if roots[label] == root_of(node["id"])]
        # The whole prefix the node ends holds its own tenant's words and no other's.
        prefix = admin.get("/cache_tree/prefix", params={"node": node["id"]}).json()
        text = prefix["above_text"] + prefix["node_text"]
        assert all(w not in text for s, w in words.items() if s != salt), (salt, text)
    for salt in prompts:
        (record,) = [r for r in tree["requests"] if r["id"] == f"tree-{words[salt]}"]
        assert record["namespace"] == labels[salt] and record["path"]
        assert all(root_of(uid) == roots[labels[salt]] for uid in record["path"])
