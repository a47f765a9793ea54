"""A speculating server over HTTP: the flags, the per-request opt-out in every API, and the
numbers in meta_info, /get_server_info and /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import POOL

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    # "always": draft lengths here must not hang on the adaptive policy's timing of this
    # machine's forwards (a busy CI machine made it draft less: accept length 1.2, not > 3).
    process = ServerProcess(
        tiny_model_path, *POOL, "--speculative-algorithm", "ngram",
        "--speculative-num-draft-tokens", "6", "--speculative-policy", "always",
    )  # fmt: skip
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _generate(server: ServerProcess, params: dict) -> dict:
    body = {"text": "ab ab ab ab ab", "sampling_params": params}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return response.json()


def test_meta_info_reports_speculation_and_the_opt_out(spec_server: ServerProcess):
    first = _generate(spec_server, GREEDY)
    again = _generate(spec_server, GREEDY)  # the first's output is in the tree now
    opted_out = _generate(spec_server, dict(GREEDY, no_speculation=True))
    assert first["output_ids"] == again["output_ids"] == opted_out["output_ids"]
    meta = again["meta_info"]
    assert meta["spec_accepted_tokens"] == meta["spec_draft_tokens"] > 0
    assert meta["spec_accept_len"] == meta["completion_tokens"] / meta["spec_verify_ct"] > 3.0
    assert "spec_accept_len" not in opted_out["meta_info"]
    info = httpx.get(f"{spec_server.url}/get_server_info", timeout=10.0).json()
    assert info["speculative_algorithm"] == "ngram"
    assert info["speculative_num_draft_tokens"] == 6
    assert info["spec_accepted_tokens"] >= meta["spec_accepted_tokens"]
    assert info["spec_accept_len"] > 1.0
    metrics = httpx.get(f"{spec_server.url}/metrics", timeout=10.0).text
    assert "# TYPE arbor_spec_draft_tokens_total counter" in metrics
    assert "arbor_spec_accept_len " in metrics


def test_openai_apis_take_the_opt_out(spec_server: ServerProcess, tiny_model_path: Path):
    model, few = str(tiny_model_path), {"max_tokens": 8}
    for path, body in (
        ("/v1/completions", {"prompt": "ab ab ab", "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **few}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 8}),
    ):
        for value in (True, False):
            response = httpx.post(
                f"{spec_server.url}{path}",
                json={"model": model, **body, "no_speculation": value, "temperature": 0},
                timeout=60.0,
            )
            assert response.status_code == 200, (path, response.text)
        bad = httpx.post(
            f"{spec_server.url}{path}",
            json={"model": model, **body, "no_speculation": "sometimes"},
            timeout=60.0,
        )
        assert bad.status_code == 400, (path, bad.text)


def test_bad_speculative_flags_stop_serve_with_a_usage_error(tiny_model_path: Path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "serve", "--model-path", str(tiny_model_path),
         "--speculative-algorithm", "draft"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "needs speculative_draft_model_path" in result.stderr
