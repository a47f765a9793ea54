"""Tenants of ``--api-keys-file`` (issue 55): each key is a tenant with a cache namespace of its
own (the same prompt and the same ``cache_salt`` from another key hits nothing), its own
stored responses, programs and request ids (another tenant gets the 404 of an id never made),
and per-tenant counters on /metrics labelled by a hash of the tenant's name. A keys file that
does not parse stops the server, naming the file and the line."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.api_keys import derived_tenant, read_api_keys, tenant_label
from runtime.server import ServerProcess
from runtime.server.http_app import ApiKeyMiddleware
from runtime.server.state import caller_is_admin, caller_of, tenant_salt
from runtime.server_args import ServerArgs
from tests.runtime.helpers import random_prompts
from tests.server.server_process import ADMIN_KEY, POOL, sse_payloads

pytestmark = pytest.mark.timeout(300)

KEY_A = "tenant-a-secret-key"
KEY_B = "tenant-b-secret-key"
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
# Long enough that its cached prefix is many tokens on the tiny test model.
PROMPT = "A tenant's system prompt, which no other tenant may find in the cache: " * 8


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ---- the keys file ----------------------------------------------------------------------------


def test_a_keys_file_gives_each_key_its_tenant(tmp_path: Path) -> None:
    text = f"# tenants\n\n{KEY_A} alice\n   \n{KEY_B}\n  # rotated out\n"
    keys = read_api_keys(_write(tmp_path / "keys", text))
    assert keys == {KEY_A: "alice", KEY_B: derived_tenant(KEY_B)}
    assert derived_tenant(KEY_B) == "key-" + hashlib.sha256(KEY_B.encode()).hexdigest()[:8]
    assert KEY_B not in derived_tenant(KEY_B)


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("k1 alice\nk2 bob extra\n", 2, "3 fields"),
        ("# keys\nk1 alice\n\nk1 bob\n", 4, "already on an earlier line"),
        ("k1\nadmin-key ops\n", 2, "--admin-api-key"),
        ("api-key\n", 1, "--api-key"),
    ],
)
def test_a_bad_line_is_named_by_its_number(
    tmp_path: Path, text: str, line: int, why: str
) -> None:
    path = _write(tmp_path / "keys", text)
    with pytest.raises(ValueError) as info:
        ServerArgs.from_kwargs(
            None, api_keys_file=path, api_key="api-key", admin_api_key="admin-key"
        )
    message = str(info.value)
    assert message.startswith(f"api_keys_file {path}, line {line}: ") and why in message
    assert "\n" not in message


def test_an_unreadable_or_empty_file_is_refused(tmp_path: Path) -> None:
    for path, why in (
        (str(tmp_path / "missing"), "cannot read it"),
        (_write(tmp_path / "empty", "# nobody yet\n"), "no key in it"),
    ):
        with pytest.raises(ValueError, match=f"^api_keys_file {path}: {why}"):
            ServerArgs.from_kwargs(None, api_keys_file=path)


def test_api_key_beside_the_file_is_the_default_tenant(tmp_path: Path) -> None:
    path = _write(tmp_path / "keys", f"{KEY_A} alice\n")
    args = ServerArgs.from_kwargs(None, api_keys_file=path, api_key="shared")
    assert args.tenant_keys() == {KEY_A: "alice", "shared": "default"}
    assert ServerArgs.from_kwargs(None, api_key="shared").tenant_keys() is None


# ---- the middleware, on a stand-in app ------------------------------------------------------


async def _whoami(request: Request) -> JSONResponse:
    return JSONResponse(
        {
            "admin": caller_is_admin(request),
            "caller": caller_of(request),
            "salt": tenant_salt(request, "s"),
        }
    )


def test_without_an_admin_key_no_tenant_opens_the_admin_routes() -> None:
    app = Starlette(routes=[Route(p, _whoami) for p in ("/generate", "/cache_tree")])
    app.add_middleware(
        ApiKeyMiddleware, api_key=None, admin_api_key=None, tenant_keys={"ka": "a", "kb": "b"}
    )
    client = TestClient(app)
    seen = {
        key: client.get("/generate", headers={"Authorization": f"Bearer {key}"}).json()
        for key in ("ka", "kb")
    }
    assert seen["ka"]["caller"] == "tenant:a" and seen["kb"]["caller"] == "tenant:b"
    assert not seen["ka"]["admin"] and not seen["kb"]["admin"]
    assert seen["ka"]["salt"] != seen["kb"]["salt"] and seen["ka"]["salt"] != "s"
    assert client.get("/cache_tree", headers={"Authorization": "Bearer ka"}).status_code == 403
    assert client.get("/generate", headers={"Authorization": "Bearer kc"}).status_code == 401


# ---- one server, two tenants ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("tenants") / "keys"
    keys.write_text(f"# two tenants\n{KEY_A} alice\n{KEY_B}\n")
    flags = ("--api-keys-file", str(keys), "--admin-api-key", ADMIN_KEY)
    with ServerProcess(tiny_model_path, *POOL, *flags) as process:
        yield process


def _client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


@pytest.fixture(scope="module")
def alice(server: ServerProcess) -> Iterator[httpx.Client]:
    with _client(server, KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def bob(server: ServerProcess) -> Iterator[httpx.Client]:
    with _client(server, KEY_B) as client:
        yield client


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    with _client(server, ADMIN_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def model(alice: httpx.Client) -> str:
    return str(alice.get("/v1/models").json()["data"][0]["id"])


def _cached(client: httpx.Client, text: str, salt: str | None = None) -> int:
    body: dict[str, Any] = {"text": text, "sampling_params": ONE_TOKEN}
    if salt is not None:
        body["cache_salt"] = salt
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["meta_info"]["cached_tokens"])


def _same_as_unknown(response: httpx.Response, unknown: httpx.Response, the_id: str) -> None:
    """``response`` (about ``the_id``) reads exactly as the answer about an id never made."""
    assert response.status_code == unknown.status_code == 404, response.text
    assert response.text.replace(the_id, "ID") == unknown.text.replace("never-made", "ID")


def test_an_unknown_key_is_a_401(server: ServerProcess) -> None:
    for headers in ({"Authorization": "Bearer not-a-key"}, {}):
        answer = httpx.post(f"{server.url}/generate", json={"text": "hi"}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def test_a_tenants_prefix_is_not_cached_for_another(
    alice: httpx.Client, bob: httpx.Client
) -> None:
    for salt in (None, "shared-salt"):  # the same salt from two keys is two namespaces
        text = f"{salt}: {PROMPT}"
        assert _cached(alice, text, salt) == 0
        assert _cached(bob, text, salt) == 0
        assert _cached(alice, text, salt) > 0
        assert _cached(bob, text, salt) > 0  # bob's own first request is cached for him


def test_a_stored_response_is_its_tenants_alone(
    alice: httpx.Client, bob: httpx.Client, model: str
) -> None:
    made = alice.post(
        "/v1/responses", json={"model": model, "input": "Remember kiwi.", "max_output_tokens": 2}
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    for path in ("/v1/responses/{}", "/v1/responses/{}/input_items"):
        unknown = bob.get(path.format("never-made"))
        _same_as_unknown(bob.get(path.format(response_id)), unknown, response_id)
    unknown = bob.delete("/v1/responses/never-made")
    _same_as_unknown(bob.delete(f"/v1/responses/{response_id}"), unknown, response_id)
    assert alice.get(f"/v1/responses/{response_id}").json()["id"] == response_id
    assert alice.delete(f"/v1/responses/{response_id}").status_code == 200


def test_a_program_is_its_tenants_alone(alice: httpx.Client, bob: httpx.Client) -> None:
    ops = [{"type": "text", "text": "A program. "},
           {"type": "gen", "name": "g", "sampling_params": ONE_TOKEN}]  # fmt: skip
    started = alice.post("/program", json={"branches": {"": ops}})
    assert started.status_code == 200, started.text
    program_id = started.json()["program_id"]
    unknown = bob.post("/program", json={"program_id": "never-made", "branches": {"": ops}})
    theirs = bob.post("/program", json={"program_id": program_id, "branches": {"": ops}})
    _same_as_unknown(theirs, unknown, program_id)
    unknown = bob.delete("/program/never-made")
    _same_as_unknown(bob.delete(f"/program/{program_id}"), unknown, program_id)
    assert alice.delete(f"/program/{program_id}").status_code == 200


def test_another_tenant_cannot_abort_a_request(alice: httpx.Client, bob: httpx.Client) -> None:
    rid = "alice-request"
    body = {"text": "A long answer:", "rid": rid, "stream": True, "sampling_params": LONG}
    with alice.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        chunks = sse_payloads(response.iter_lines())
        next(chunks)
        unknown = bob.post("/abort_request", json={"rid": "never-made"})
        _same_as_unknown(bob.post("/abort_request", json={"rid": rid}), unknown, rid)
        mine = bob.post("/generate", json={**body, "stream": False, "sampling_params": ONE_TOKEN})
        assert mine.status_code == 200, mine.text  # the id is free in bob's namespace
        assert alice.post("/abort_request", json={"rid": rid}).status_code == 200
        last = list(chunks)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


def test_the_admin_routes_need_the_admin_key(alice: httpx.Client, admin: httpx.Client) -> None:
    refused = alice.get("/cache_tree")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert admin.get("/cache_tree").status_code == 200
    assert "api_keys_file" not in alice.get("/get_server_info").json()
    assert admin.get("/get_server_info").json()["api_keys_file"].endswith("keys")


def test_metrics_count_each_tenant_under_a_hash_of_its_name(
    server: ServerProcess, alice: httpx.Client, bob: httpx.Client
) -> None:
    for client in (alice, bob, alice, bob):  # each repeat is cached
        _cached(client, PROMPT)
    text = httpx.get(f"{server.url}/metrics").text
    for tenant in ("alice", derived_tenant(KEY_B)):
        label = tenant_label(tenant)
        for name in ("requests", "prompt_tokens", "cached_tokens"):
            line = next(
                row for row in text.splitlines()
                if row.startswith(f'arbor_tenant_{name}_total{{tenant="{label}"}} ')
            )  # fmt: skip
            assert float(line.split()[-1]) > 0, line
    for secret in (KEY_A, KEY_B, ADMIN_KEY, "alice", derived_tenant(KEY_B)):
        assert secret not in text


def test_a_flooding_tenant_evicts_its_own_cache_not_anothers(
    server: ServerProcess, alice: httpx.Client, bob: httpx.Client, admin: httpx.Client
) -> None:
    assert admin.post("/flush_cache").status_code == 200
    quiet = list(range(100, 1100))  # 1000 tokens, well under an equal share of the pool
    alice.post("/generate", json={"input_ids": quiet, "sampling_params": ONE_TOKEN})
    for ids in random_prompts([1000] * 20, seed=55):  # 2.5 pools of bob's unique prompts
        answer = bob.post("/generate", json={"input_ids": ids, "sampling_params": ONE_TOKEN})
        assert answer.status_code == 200, answer.text
    again = alice.post("/generate", json={"input_ids": quiet, "sampling_params": ONE_TOKEN})
    assert again.json()["meta_info"]["cached_tokens"] >= 999
    info = admin.get("/get_server_info").json()
    evicted = info["tenant_kv_evicted_tokens"]
    flood, quiet_label = tenant_label(derived_tenant(KEY_B)), tenant_label("alice")
    assert evicted[flood] >= 10_000 and quiet_label not in evicted
    assert info["tenant_kv_cached_tokens"][quiet_label] >= 1000
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'arbor_tenant_evicted_tokens_total{{tenant="{flood}"}} {evicted[flood]}' in metrics
