"""The live dashboard in real Chromium (headless, driven by Playwright for Python).

A server on the tiny model runs requests sharing a prefix and a DSL fork program; the page must
show the shared node with its token count, the fork's parent node shared by its branches, the
hit rate of /get_server_info, a new request without a reload, the path of a clicked request,
a hovered node's whole prefix, the nodes a flush evicts, and no console error. On failure a
screenshot is saved in the test's temporary directory (the failure message names it).

Needs the ``playwright`` package and the Debian ``chromium`` package (``make
install-browser``); Playwright's own browser download is never used. Without them the test is
skipped, saying so. ``ARBOR_CHROMIUM`` names another Chromium executable;
``ARBOR_DASHBOARD_SCREENSHOT=PATH`` saves a screenshot of the passing page there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

import frontend_lang as fl
from runtime.server import ServerProcess
from tests.server.server_process import POOL

pytestmark = pytest.mark.timeout(300)

SHARED = "You review pull requests for a radix-tree cache. Be brief and concrete.\n"
QUESTIONS = ["Question: is eviction safe?", "Task: name one risk.", "Why split nodes?"]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
UPDATE_TIMEOUT_MS = 15_000


def chromium_executable() -> str | None:
    for candidate in (os.environ.get("ARBOR_CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the dashboard browser test needs Playwright for Python: make install-browser")
    executable = chromium_executable()
    if executable is None:
        pytest.skip(
            "the dashboard browser test needs Chromium (no chromium or chromium-browser on "
            "PATH, ARBOR_CHROMIUM unset): make install-browser"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    """A server of its own: the tree must hold only what this test puts there."""
    with ServerProcess(tiny_model_path, *POOL) as process:
        yield process


def generate(server: ServerProcess, text: str, rid: str) -> dict:
    body = {"text": text, "rid": rid, "sampling_params": GREEDY}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@fl.function
def review(s):
    s += "A fork program: two reviewers read the same diff.\nDiff: evict() frees leaves.\n"
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += f"Reviewer {'AB'[i]} verdict:" + fl.gen("verdict", max_tokens=4, temperature=0)
    forks.join()


def shared_prefix_len(tokenizer: Any) -> int:
    """Tokens every SHARED + question prompt starts with (BOS included)."""
    ids = [tokenizer(SHARED + q).input_ids for q in QUESTIONS]
    length = 0
    while all(len(i) > length for i in ids) and len({i[length] for i in ids}) == 1:
        length += 1
    return length


def test_dashboard_shows_the_tree_live(
    browser: Any, server: ServerProcess, tiny_model_path: Path, tmp_path: Path
):  # the browser first: without one the test skips before starting a server
    shared_len = shared_prefix_len(AutoTokenizer.from_pretrained(tiny_model_path))
    for i, question in enumerate(QUESTIONS):
        generate(server, SHARED + question, f"shared-{i}")
    review.run(backend=fl.RuntimeEndpoint(server.url))

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    try:
        check_page(page, server, shared_len, os.environ.get("ARBOR_DASHBOARD_SCREENSHOT"))
        assert not errors, f"console errors: {errors}"
    except BaseException:
        shot = tmp_path / "dashboard-failure.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot of the failing page: {shot}; console errors: {errors}")
        raise
    finally:
        page.close()


def check_page(page: Any, server: ServerProcess, shared_len: int, screenshot: str | None) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_function("() => Number(document.body.dataset.updates || 0) >= 2")
    page.evaluate("window.loadMarker = 'first load'")

    # The shared prompt prefix ends at one node (the fork program shares its first token, so
    # that node starts after it), and its three questions branch off there.
    tree = httpx.get(f"{server.url}/cache_tree", timeout=30).json()
    shared = [n for n in tree["nodes"] if n["prefix_tokens"] + n["tokens"] == shared_len]
    assert len(shared) == 1, tree["nodes"]
    node_tokens = shared_len - shared[0]["prefix_tokens"]
    assert node_tokens >= shared_len - 1
    row = page.locator(f'.node[data-node-id="{shared[0]["id"]}"]')
    assert row.locator(".tokens").inner_text() == f"{node_tokens} tok"
    assert "3 branches" in row.locator(".meta").inner_text()
    assert SHARED.strip()[:30] in row.locator(".text").inner_text()

    # The fork program: its branches share the node that ends where they fork.
    fork_rows = page.locator(".node.shared", has_text="Reviewer")
    if fork_rows.count() == 0:  # " Reviewer" may be split into the branches' own nodes
        fork_rows = page.locator(".node.shared", has_text="Diff:")
    assert fork_rows.count() == 1
    assert "2 branches" in fork_rows.first.locator(".meta").inner_text()

    # The hit rate is the scheduler's (nothing runs now, so it holds still).
    info = server.server_info()
    page.wait_for_function(
        "(expected) => Math.abs(parseFloat(document.getElementById('hit-rate').textContent)"
        " - expected) < 0.051",
        arg=100 * info["cache_hit_rate"],
        timeout=UPDATE_TIMEOUT_MS,
    )

    # A new request shows up without a reload.
    generate(server, SHARED + "Question: one more?", "live-request")
    latest = page.locator("#requests tbody tr", has_text="live-request")
    latest.wait_for(timeout=UPDATE_TIMEOUT_MS)
    assert page.evaluate("window.loadMarker") == "first load"

    # Clicking it highlights its path: the shared node among it.
    latest.click()
    page.locator(f'.node.on-path[data-node-id="{shared[0]["id"]}"]').wait_for(timeout=5000)
    assert page.locator("#path-note").inner_text().startswith("live-request:")
    if screenshot:
        page.screenshot(path=screenshot)

    # Hovering a node shows its whole prefix, the node's own part marked.
    row.hover()
    page.locator("#tooltip mark").wait_for(timeout=UPDATE_TIMEOUT_MS)
    assert page.locator("#tooltip pre").inner_text().rstrip().endswith(SHARED.strip())
    page.mouse.move(0, 0)

    # Flushing the cache evicts every node: the page shows them as just evicted.
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    ghost = page.locator(f'.node.evicted[data-node-id="{shared[0]["id"]}"]')
    ghost.wait_for(timeout=UPDATE_TIMEOUT_MS)
    assert "evicted" in ghost.locator(".meta").inner_text()
