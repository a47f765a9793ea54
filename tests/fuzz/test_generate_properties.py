"""``/generate`` with generated sampling params, JSON schemas, regexes and cache salts (see
strategies): each request answers 200 or a 4xx with a message within REQUEST_TIMEOUT_S and
keeps the server's invariant; a constrained output that finished by a stop (not by running out
of tokens) satisfies its constraint: the JSON parses and validates against the schema (with
formats checked), the regex full-matches; a valid salt is served (its repeat from its cache),
an invalid one is a 400 naming ``cache_salt``."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.budget import LONG_RUN, fuzz_settings, run_rounds
from tests.fuzz.fuzz_server import REQUEST_TIMEOUT_S, FuzzServer, check_reply
from tests.fuzz.strategies import (
    INT64_MAX,
    encoded_bodies,
    invalid_salts,
    json_schemas,
    regexes,
    sampling_params,
    texts,
    valid_salts,
)

pytestmark = pytest.mark.timeout(0 if LONG_RUN else 300)

# Shares of ARBOR_FUZZ_SECONDS in the long run (test_api_random_cases has half,
# test_schema_fail_closed a tenth: they add up to the whole).
SAMPLING_SHARE = 0.15
SCHEMA_SHARE = 0.1
REGEX_SHARE = 0.1
SALT_SHARE = 0.05
JSON_HEADERS = {"Content-Type": "application/json"}


def post_generate(server: FuzzServer, raw: bytes) -> tuple[httpx.Response, str]:
    """Send ``raw`` to /generate, check the reply and the server; the reply and a description
    of the request for messages."""
    request = f"POST /generate {raw[:3000]!r}"
    url = f"{server.url}/generate"
    response = server.send(
        lambda: httpx.post(url, content=raw, headers=JSON_HEADERS, timeout=REQUEST_TIMEOUT_S),
        request,
    )
    content_type = response.headers.get("content-type", "")
    check_reply(response.status_code, content_type, response.content, request)
    server.check_after(request)
    return response, request


def _schema_error(schema: dict[str, Any], text: str) -> str | None:
    """Why the JSON ``text`` fails ``schema`` (formats checked), or None. Numbers may be read
    as doubles or exactly, as decimals, and the output need only pass one reading: the server
    writes a const of 2.40296877285632e-93 as 2.4029687728563198e-93 (the same double, not
    the same decimal), and -9223372036854775808.16 satisfies ``exclusiveMaximum: -2**63``
    exactly but not as a double."""
    errors: list[str] = []
    for parse_float in (float, Decimal):
        read = json.loads(json.dumps(schema), parse_float=parse_float)
        value = json.loads(text, parse_float=parse_float)
        validator = jsonschema.validators.validator_for(read, jsonschema.Draft202012Validator)
        found = validator(read, format_checker=validator.FORMAT_CHECKER).iter_errors(value)
        error = jsonschema.exceptions.best_match(found)
        if error is None:
            return None
        errors.append(error.message)
    return "; ".join(errors)


def _stopped(result: dict[str, Any]) -> bool:
    return result["meta_info"]["finish_reason"]["type"] == "stop"


def test_sampling_params(fuzz_server: FuzzServer) -> None:
    @fuzz_settings(slice_examples=40)
    @given(
        params=sampling_params(),
        prompt=texts,
        stream=st.booleans(),
        default_length=st.integers(0, 9),
        data=st.data(),
    )
    @example(
        params={"max_new_tokens": INT64_MAX, "min_new_tokens": INT64_MAX, "n": 2},
        prompt=" x" * 500,  # 501 tokens: 11 fit in the context
        stream=False,
        default_length=1,
        data=None,
    ).via("the overflow edge: as many tokens as the context holds")
    def case(
        params: dict[str, Any], prompt: str, stream: bool, default_length: int, data: Any
    ) -> None:
        if default_length:  # else the default, 128 tokens
            params.setdefault("max_new_tokens", 12)
        body = {"text": prompt, "sampling_params": params, "stream": stream}
        raw = data.draw(encoded_bodies(body)) if data is not None else json.dumps(body).encode()
        response, request = post_generate(fuzz_server, raw)
        if response.status_code == 200 and not stream:
            results = response.json()
            for result in results if isinstance(results, list) else [results]:
                assert isinstance(result["text"], str), request
                tokens = result["meta_info"]["completion_tokens"]
                assert tokens <= params.get("max_new_tokens", 128), (request, result)

    run_rounds(case, SAMPLING_SHARE)


def test_json_schema_outputs_validate(fuzz_server: FuzzServer) -> None:
    @fuzz_settings(slice_examples=30)
    @given(
        schema=json_schemas(),
        as_text=st.booleans(),
        whitespace=st.sampled_from([0, 0, 2]),
        seed=st.integers(0, 2**32),
    )
    def case(schema: dict[str, Any], as_text: bool, whitespace: int, seed: int) -> None:
        params = {
            "json_schema": json.dumps(schema) if as_text else schema,
            "grammar_max_whitespace": whitespace,
            "max_new_tokens": 32,
            "seed": seed,
        }
        body = {"text": "The answer as JSON: ", "sampling_params": params}
        response, request = post_generate(fuzz_server, json.dumps(body).encode())
        if response.status_code != 200 or not _stopped(response.json()):
            return
        text = response.json()["text"]
        try:
            json.loads(text)
        except ValueError:
            raise AssertionError(f"output {text!r} is not JSON for {request}") from None
        error = _schema_error(schema, text)
        assert error is None, f"output {text!r} fails the schema ({error}): {request}"

    run_rounds(case, SCHEMA_SHARE)


def test_regex_outputs_match(fuzz_server: FuzzServer) -> None:
    @fuzz_settings(slice_examples=30)
    @given(regex=regexes, seed=st.integers(0, 2**32))
    def case(regex: str, seed: int) -> None:
        params = {"regex": regex, "max_new_tokens": 24, "seed": seed}
        body = {"text": "Match: ", "sampling_params": params}
        response, request = post_generate(fuzz_server, json.dumps(body).encode())
        if response.status_code == 200 and _stopped(response.json()):
            text = response.json()["text"]
            assert re.fullmatch(regex, text), f"output {text!r} does not match: {request}"

    run_rounds(case, REGEX_SHARE)


def test_cache_salts(fuzz_server: FuzzServer) -> None:
    @fuzz_settings(slice_examples=24)
    @given(
        salt=st.tuples(valid_salts, st.just(True)) | st.tuples(invalid_salts, st.just(False)),
        stream=st.booleans(),
    )
    def case(salt: tuple[Any, bool], stream: bool) -> None:
        value, valid = salt
        body = {
            "text": "A prompt every salt sends, long enough to fill a few pages.",
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "cache_salt": value,
            "stream": stream,
        }
        raw = json.dumps(body).encode()  # a lone surrogate goes escaped: the salt's own error
        response, request = post_generate(fuzz_server, raw)
        if not valid:
            assert response.status_code == 400, request
            assert response.json()["error"]["param"] == "cache_salt", (request, response.text)
            return
        assert response.status_code == 200, (request, response.text)
        if not stream:  # its repeat is served from the salt's cache (the last token runs)
            again, _ = post_generate(fuzz_server, raw)
            meta = again.json()["meta_info"]
            assert meta["cached_tokens"] == meta["prompt_tokens"] - 1, (request, meta)

    run_rounds(case, SALT_SHARE)
