"""What a tenant owns on a shared server (issue 51): compiled programs, request ids and stored
responses belong to the caller's key and ``cache_salt`` that made them. A continuation never
runs in a fresh session (an unknown program is a 404, an ended one a 410 saying why), another
tenant gets the plain 404 of an id that never existed, and deleting a running program ends its
waiters with a proper error."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.server import ServerProcess
from tests.server.server_process import ADMIN_KEY, POOL, sse_payloads

pytestmark = pytest.mark.timeout(300)

API_KEY = "owner-test-key"
PIN_TIMEOUT_S = 3.0
MAX_PROGRAMS = 8
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}
# Long enough that a test acts on it while it runs (the tiny model decodes it in seconds).
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[ServerProcess]:
    flags = (
        "--program-pin-timeout-s", str(PIN_TIMEOUT_S),
        "--max-programs-per-tenant", str(MAX_PROGRAMS),
        "--admin-api-key", ADMIN_KEY,
    )  # fmt: skip
    with ServerProcess(tiny_model_path, *POOL, *flags, api_key=API_KEY) as process:
        yield process


@pytest.fixture(scope="module")
def model(tenant: httpx.Client) -> str:
    return str(tenant.get("/v1/models").json()["data"][0]["id"])


def _ops(text: str = "A program about caches. ", params: dict[str, Any] | None = None) -> Any:
    return [{"type": "text", "text": text}, {"type": "gen", "name": "g",
                                             "sampling_params": params or ONE_TOKEN}]  # fmt: skip


def _segment(
    client: httpx.Client, program_id: str | None, salt: str | None, ops: Any = ()
) -> httpx.Response:
    body: dict[str, Any] = {"branches": {"": list(ops)}}
    if program_id is not None:
        body["program_id"] = program_id
    if salt is not None:
        body["cache_salt"] = salt
    return client.post("/program", json=body)


def _start(client: httpx.Client, salt: str | None) -> str:
    response = _segment(client, None, salt, _ops())
    assert response.status_code == 200, response.text
    return str(response.json()["program_id"])


def _refused(response: httpx.Response, status: int, code: str, program_id: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "program_id", error
    assert program_id in error["message"]
    return str(error["message"])


def _same_as_unknown(response: httpx.Response, unknown: httpx.Response, the_id: str) -> None:
    """``response`` (about ``the_id``) reads exactly as the answer about an id never made."""
    assert response.status_code == unknown.status_code == 404, response.text
    assert response.text.replace(the_id, "ID") == unknown.text.replace("never-made", "ID")


# ---- continuations never start afresh ----------------------------------------------------------


def test_a_continuation_of_an_unknown_program_is_a_404_naming_it(tenant: httpx.Client) -> None:
    for _ in range(2):  # the first refusal created nothing to continue
        response = _segment(tenant, "never-started", "salt-u", _ops())
        message = _refused(response, 404, "program_not_found", "never-started")
        assert "without program_id" in message


def test_a_deleted_program_is_a_410_saying_so(tenant: httpx.Client) -> None:
    program_id = _start(tenant, "salt-d")
    deleted = tenant.delete(f"/program/{program_id}", params={"cache_salt": "salt-d"})
    assert deleted.status_code == 200 and deleted.json() == {"success": True}
    message = _refused(_segment(tenant, program_id, "salt-d", _ops()), 410, "program_deleted",
                       program_id)  # fmt: skip
    assert "deleted" in message
    again = tenant.delete(f"/program/{program_id}", params={"cache_salt": "salt-d"})
    _refused(again, 410, "program_deleted", program_id)


def test_an_ended_program_is_a_410_saying_so(tenant: httpx.Client) -> None:
    program_id = _start(tenant, None)
    last = tenant.post("/program", json={"program_id": program_id, "branches": {}, "end": True})
    assert last.status_code == 200, last.text
    _refused(_segment(tenant, program_id, None), 410, "program_ended", program_id)


def test_an_idle_program_expires_after_the_pin_timeout(tenant: httpx.Client) -> None:
    program_id = _start(tenant, "salt-e")
    assert _segment(tenant, program_id, "salt-e").status_code == 200  # within the timeout
    time.sleep(PIN_TIMEOUT_S + 0.5)
    message = _refused(_segment(tenant, program_id, "salt-e", _ops()), 410, "program_expired",
                       program_id)  # fmt: skip
    assert "--program-pin-timeout-s" in message


def test_a_flood_of_programs_evicts_the_flooding_tenants_own(tenant: httpx.Client) -> None:
    victim = _start(tenant, "salt-victim")
    flood = [_start(tenant, "salt-flood") for _ in range(MAX_PROGRAMS + 4)]
    kept = _segment(tenant, victim, "salt-victim", _ops(" and on."))
    assert kept.status_code == 200, kept.text
    assert kept.json()["events"][-1]["type"] == "done"
    for program_id in flood[:4]:  # the flooder's oldest went, each reported
        _refused(_segment(tenant, program_id, "salt-flood"), 410, "program_evicted", program_id)
    for program_id in flood[4:]:
        assert _segment(tenant, program_id, "salt-flood").status_code == 200


# ---- another tenant gets the 404 of an id never made ----------------------------------------


def test_another_tenant_can_neither_continue_nor_delete_a_program(
    tenant: httpx.Client, admin: httpx.Client
) -> None:
    program_id = _start(tenant, "salt-owner")
    for client, salt in ((tenant, "salt-other"), (tenant, None), (admin, "salt-owner")):
        params = {} if salt is None else {"cache_salt": salt}
        unknown = client.delete("/program/never-made", params=params)
        _same_as_unknown(client.delete(f"/program/{program_id}", params=params), unknown,
                         program_id)  # fmt: skip
        unknown = _segment(client, "never-made", salt, _ops())
        _same_as_unknown(_segment(client, program_id, salt, _ops()), unknown, program_id)
    kept = _segment(tenant, program_id, "salt-owner", _ops(" and on."))
    assert kept.status_code == 200 and kept.json()["events"][-1]["type"] == "done"


def test_another_salt_cannot_abort_a_request(tenant: httpx.Client) -> None:
    rid = "victim-request"
    body = {"text": "A long answer:", "rid": rid, "stream": True, "cache_salt": "salt-owner",
            "sampling_params": {**LONG, "max_new_tokens": 1500}}  # fmt: skip
    with tenant.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        chunks = sse_payloads(response.iter_lines())
        first = next(chunks)
        unknown = tenant.post("/abort_request", json={"rid": "never-made", "cache_salt": "x"})
        attack = tenant.post("/abort_request", json={"rid": rid, "cache_salt": "x"})
        _same_as_unknown(attack, unknown, rid)
        assert tenant.post("/abort_request", json={"rid": rid}).status_code == 404
        # The victim still runs: its own salt finds the id in use. Another salt may use it.
        taken = tenant.post("/generate", json={**body, "stream": False})
        assert taken.status_code == 400 and "in use" in taken.text
        mine = tenant.post("/generate", json={**body, "stream": False, "cache_salt": "x",
                                              "sampling_params": ONE_TOKEN})  # fmt: skip
        assert mine.status_code == 200, mine.text
        last = [first, *chunks][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["completion_tokens"] == 1500


def test_the_owner_aborts_its_own_request(tenant: httpx.Client) -> None:
    body = {"text": "A long answer:", "rid": "own-request", "stream": True, "cache_salt": "s",
            "sampling_params": LONG}  # fmt: skip
    with tenant.stream("POST", "/generate", json=body) as response:
        chunks = sse_payloads(response.iter_lines())
        next(chunks)
        aborted = tenant.post("/abort_request", json={"rid": "own-request", "cache_salt": "s"})
        assert aborted.status_code == 200 and aborted.json() == {"success": True}
        last = list(chunks)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_stored_response_is_its_tenants_alone(
    tenant: httpx.Client, admin: httpx.Client, model: str
) -> None:
    made = tenant.post(
        "/v1/responses",
        json={
            "model": model,
            "input": "Remember the word kiwi.",
            "max_output_tokens": 2,
            "cache_salt": "salt-owner",
        },
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    for client, salt in ((tenant, "salt-other"), (tenant, None), (admin, "salt-owner")):
        params = {} if salt is None else {"cache_salt": salt}
        for path in ("/v1/responses/{}", "/v1/responses/{}/input_items"):
            unknown = client.get(path.format("never-made"), params=params)
            _same_as_unknown(client.get(path.format(response_id), params=params), unknown,
                             response_id)  # fmt: skip
        unknown = client.delete("/v1/responses/never-made", params=params)
        _same_as_unknown(client.delete(f"/v1/responses/{response_id}", params=params), unknown,
                         response_id)  # fmt: skip
        turn = {"model": model, "input": "Which word?", "max_output_tokens": 2,
                **({} if salt is None else {"cache_salt": salt})}  # fmt: skip
        unknown = client.post("/v1/responses", json={**turn, "previous_response_id": "never-made"})
        theirs = client.post("/v1/responses", json={**turn, "previous_response_id": response_id})
        _same_as_unknown(theirs, unknown, response_id)
    mine = {"cache_salt": "salt-owner"}
    assert tenant.get(f"/v1/responses/{response_id}", params=mine).json()["id"] == response_id
    assert tenant.get(f"/v1/responses/{response_id}/input_items", params=mine).status_code == 200
    turn = {"model": model, "input": "Which word?", "max_output_tokens": 2, **mine,
            "previous_response_id": response_id}  # fmt: skip
    assert tenant.post("/v1/responses", json=turn).status_code == 200
    assert tenant.delete(f"/v1/responses/{response_id}", params=mine).status_code == 200


# ---- deleting a running program ---------------------------------------------------------------


def test_deleting_a_running_program_ends_its_stream_with_an_error_event(
    tenant: httpx.Client,
) -> None:
    body = {"branches": {"": _ops(params=LONG)}, "stream": True, "cache_salt": "salt-r"}
    with tenant.stream("POST", "/program", json=body) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
        program_id = next(events)["program_id"]
        assert next(events)["type"] == "delta"  # it runs
        deleted = tenant.delete(f"/program/{program_id}", params={"cache_salt": "salt-r"})
        assert deleted.status_code == 200
        rest = list(events)  # up to data: [DONE]
    errors = [e["error"] for e in rest if "error" in e and "type" not in e]
    assert len(errors) == 1 and "deleted" in errors[0]["message"], rest[-3:]
    assert program_id in errors[0]["message"] and "error" in rest[-1]


def test_deleting_a_running_program_answers_its_json_waiter_409(tenant: httpx.Client) -> None:
    program_id = _start(tenant, "salt-j")
    answer: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answer.append(_segment(tenant, program_id, "salt-j", _ops(params=LONG)))
    )
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while _segment(tenant, program_id, "salt-j").status_code != 409:  # busy: it runs
            assert time.monotonic() < deadline and not answer, answer
            time.sleep(0.05)
        deleted = tenant.delete(f"/program/{program_id}", params={"cache_salt": "salt-j"})
        assert deleted.status_code == 200
    finally:
        waiter.join(60)
    (response,) = answer
    assert response.status_code == 409, response.text
    assert response.headers["content-type"] == "application/json"
    assert "deleted" in response.json()["error"]["message"]
    _refused(_segment(tenant, program_id, "salt-j"), 410, "program_deleted", program_id)
