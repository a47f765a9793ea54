"""``GET /cache_tree`` and ``/cache_tree/prefix`` on the real server, and the dashboard's event
stream: bounded, folded, decoded, consistent with the cache's own counters."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from runtime.server import ServerProcess

pytestmark = pytest.mark.timeout(300)

# Long enough that its node's text is cut in the middle (head 32 + tail 8 tokens).
PROMPT = (
    "Dashboard test prompt. The radix cache keeps every prefix it has seen, so a later request "
    "that starts with the same tokens reuses their KV instead of computing it again; this "
    "sentence only has to be long and made of plain ASCII words so that it decodes exactly."
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def finished(server: ServerProcess) -> dict:
    """One request whose tokens are all in the tree (its prompt, then 4 generated tokens)."""
    body = {
        "text": PROMPT,
        "rid": "cache-tree-probe",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def decode(tokenizer, ids: list[int]) -> str:
    """As the server decodes node runs: special tokens kept, no clean-up."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def cache_tree(server: ServerProcess, **params: object) -> httpx.Response:
    return httpx.get(f"{server.url}/cache_tree", params=params, timeout=30)


def test_nodes_hold_the_decoded_runs_of_their_tokens(
    server: ServerProcess, finished: dict, tokenizer
):
    tree = cache_tree(server, max_nodes=500).json()
    nodes = {n["id"]: n for n in tree["nodes"]}
    (probe,) = [r for r in tree["requests"] if r["id"] == "cache-tree-probe"]
    ids = tokenizer(PROMPT).input_ids + finished["output_ids"]
    assert probe["prompt_tokens"] + probe["completion_tokens"] == len(ids)
    assert probe["path_tokens"] >= len(ids) - 1  # all with KV (the last token has none)
    assert probe["finish_reason"] == {"type": "length", "length": 4}
    elided = 0
    for uid in probe["path"]:
        node = nodes[uid]
        run = ids[node["prefix_tokens"] : node["prefix_tokens"] + node["tokens"]]
        if len(run) < node["tokens"]:  # a node that goes on past this request
            continue
        if node["elided_tokens"]:
            elided += 1
            assert node["text"] == decode(tokenizer, run[:32])
            assert node["tail_text"] == decode(tokenizer, run[-8:])
            assert node["elided_tokens"] == len(run) - 40
        else:
            assert node["text"] + node["tail_text"] == decode(tokenizer, run)
    assert elided >= 1  # the long prompt was cut in the middle somewhere on its path
    whole = httpx.get(
        f"{server.url}/cache_tree/prefix", params={"node": probe["path"][-1]}, timeout=30
    ).json()
    assert whole["tokens"] == probe["path_tokens"]
    assert (whole["above_text"] + whole["node_text"]).startswith(decode(tokenizer, ids[:-8]))


def test_bounded_folded_and_consistent_with_the_cache(server: ServerProcess, finished: dict):
    for max_nodes in (1, 3, 500):
        tree = cache_tree(server, max_nodes=max_nodes).json()
        stats = tree["stats"]
        assert len(tree["nodes"]) <= max_nodes
        assert tree["shown_tokens"] + tree["folded_tokens"] == stats["cached_tokens"]
        # One root per cache salt in use (the server is shared with other test modules).
        roots = [node for node in tree["nodes"] if node["parent"] is None]
        assert tree["shown_nodes"] == len(tree["nodes"]) - len(roots)
        for node in tree["nodes"]:
            shown = [n for n in tree["nodes"] if n["parent"] == node["id"]]
            assert node["children"] == len(shown) + node["folded_children"]
            assert node["state"] in {"root", "locked", "evictable"}
    top = cache_tree(server, max_nodes=1).json()
    (root,) = top["nodes"]  # everything else folded, other salts' roots included
    assert root["state"] == "root" and root["folded_tokens"] > 0  # the heaviest root
    assert top["folded_tokens"] == stats["cached_tokens"] and top["shown_tokens"] == 0
    # Other salts' roots (each holding tokens: an emptied one is forgotten) are counted apart.
    others = top["folded_tokens"] - root["folded_tokens"]
    assert (top["folded_namespaces"] > 0) == (others > 0)
    assert root["folded_children"] == root["children"] >= 1
    info = server.server_info()  # nothing runs now: the same moment as far as the cache goes
    assert info["kv_cached_tokens"] == tree["stats"]["cached_tokens"]
    assert tree["stats"]["protected_tokens"] == 0


@pytest.mark.parametrize("bad", ["0", "501", "-3", "many"])
def test_bad_max_nodes_is_a_400_naming_it(server: ServerProcess, bad: str):
    response = cache_tree(server, max_nodes=bad)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_nodes" and "max_nodes" in error["message"]


def test_prefix_of_an_unknown_node_is_a_404(server: ServerProcess):
    response = httpx.get(f"{server.url}/cache_tree/prefix", params={"node": 10**12}, timeout=30)
    assert response.status_code == 404
    assert "not in the latest snapshot" in response.json()["error"]["message"]


def test_the_dashboard_page_and_its_files(server: ServerProcess):
    page = httpx.get(f"{server.url}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name in ("dashboard.js", "dashboard.css"):  # the entry module imports the others
        assert f"dashboard/static/{name}" in page.text
    for name in (
        "dashboard.js",
        "dashboard.css",
        "charts.js",
        "format.js",
        "tooltip.js",
        "tree.js",
    ):
        asset = httpx.get(f"{server.url}/dashboard/static/{name}", timeout=30)
        assert asset.status_code == 200 and asset.text
    for name in ("index.html", "cache_tree.py", "nope.js"):  # only the page's own files
        assert httpx.get(f"{server.url}/dashboard/static/{name}").status_code == 404
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    assert "/cache_tree" in paths and not any(p.startswith("/dashboard") for p in paths)


def events(server: ServerProcess, count: int) -> Iterator[tuple[float, dict]]:
    with httpx.stream("GET", f"{server.url}/dashboard/events", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield time.monotonic(), json.loads(line[len("data: ") :])
                count -= 1
                if count == 0:
                    return


def test_the_event_stream_sends_bounded_updates_twice_a_second(
    server: ServerProcess, finished: dict
):
    received = list(events(server, 4))
    gaps = [b[0] - a[0] for a, b in zip(received, received[1:], strict=False)]
    assert all(0.3 < gap < 1.5 for gap in gaps), gaps
    for _, update in received:
        assert set(update) == {"time", "model", "server_info", "tree", "steps", "latency"}
        assert len(update["tree"]["nodes"]) <= 200 and len(update["steps"]) <= 120
        assert update["tree"]["snapshot_ms"] < 50
    assert any(r["id"] == "cache-tree-probe" for r in received[-1][1]["tree"]["requests"])
