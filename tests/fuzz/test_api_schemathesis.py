"""Schemathesis against the live server, driven by its ``/openapi.json``. Each case must keep
the invariant of ``fuzz_server`` (no 5xx, 4xx with a message, healthy, KV back to baseline).

- ``test_api_explicit_cases``: the coverage phase's cases for every operation (each field at
  its boundaries, missing, null, of the wrong type; unknown fields; unexpected methods): all
  of them in the long run, a fixed share picked by hash in the bounded slice
  (``budget.in_slice``).
- ``test_api_random_cases``: random valid and invalid requests to random operations, round
  after round in the long run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import given
from schemathesis import Case, GenerationMode

from tests.fuzz.budget import LONG_RUN, fuzz_settings, in_slice, run_rounds
from tests.fuzz.fuzz_server import REQUEST_TIMEOUT_S, FuzzServer, cap_token_counts, check_reply

pytestmark = pytest.mark.timeout(0 if LONG_RUN else 300)

# The share of ARBOR_FUZZ_SECONDS the random cases get in the long run.
RANDOM_SHARE = 0.5
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 20261123,
        "generation": {"mode": "all"},
        "phases": {"fuzzing": {"enabled": False}, "stateful": {"enabled": False}},
        "max-stream-events": 100_000,  # read every stream to its end, to check it
        "request-timeout": REQUEST_TIMEOUT_S,
    }
)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: FuzzServer) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=CONFIG)
    schema.validate()
    return schema


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def send_and_check(case: Case, server: FuzzServer, session: requests.Session) -> None:
    cap_token_counts(case.path, case.body)
    url = server.url
    request = case.as_curl_command(base_url=url)
    response = server.send(
        lambda: case.call(base_url=url, session=session, timeout=REQUEST_TIMEOUT_S), request
    )
    assert not response.stream_cut_short, f"the event stream was cut short: {request}"
    content_type = response.headers.get("content-type", [""])[0]
    check_reply(response.status_code, content_type, response.content, request)
    server.check_after(request)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32 reads and renames ``item._nodeid``, which pytest 9.2 no longer has
    (it keeps ``_id``); an instance attribute satisfies it without touching pytest."""
    request.node._nodeid = request.node.nodeid


@schema.parametrize()
@fuzz_settings(slice_examples=1)  # explicit cases only: CONFIG turns the fuzzing phase off
def test_api_explicit_cases(case: Case, fuzz_server: FuzzServer, session: requests.Session) -> None:
    if in_slice(case.as_curl_command(base_url="http://fuzz")):  # the same cases, any port
        send_and_check(case, fuzz_server, session)


def test_api_random_cases(
    api_schema: schemathesis.BaseSchema, fuzz_server: FuzzServer, session: requests.Session
) -> None:
    cases = api_schema.as_strategy(GenerationMode.POSITIVE) | api_schema.as_strategy(
        GenerationMode.NEGATIVE
    )

    @fuzz_settings(slice_examples=80)
    @given(case=cases)
    def case(case: Case) -> None:
        send_and_check(case, fuzz_server, session)

    run_rounds(case, RANDOM_SHARE)
