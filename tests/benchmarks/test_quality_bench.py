"""benchmarks/quality_bench: the frozen task sets are well-formed, and the scoring reads answers
out of outputs and counts them right (no server: responses are canned)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import quality_bench, quality_modes
from benchmarks.quality_modes import NO_FIELD_NOTE, Client, Generation, Refused
from benchmarks.quality_tasks import (
    DATA_DIR,
    MIN_ITEMS,
    fields_right,
    find_json_object,
    is_valid,
    load_tasks,
    normalize,
    read_label,
    tool_arguments,
)


def test_every_task_set_has_enough_items_each_with_a_checkable_answer() -> None:
    tasks = load_tasks()
    assert {t.name for t in tasks} == {
        "extraction", "booking", "classification", "tool_weather", "tool_weather_unit",
        "no_call",
    }  # fmt: skip
    for task in tasks:
        assert len(task.items) >= MIN_ITEMS, task.name
        for item in task.items:
            assert item.text and item.answer, item.id
            if task.kind == "label":
                assert set(item.answer) == {task.field}
                assert item.answer[task.field] in task.labels
            else:
                assert set(item.answer) == set(task.output_schema["properties"]), item.id
                assert is_valid(item.answer, task.output_schema), item.id
            # Each answer's strings are in the text, so the answer is there to be read.
            for value in item.answer.values():
                if isinstance(value, str) and task.kind != "label":
                    assert value.casefold() in item.text.casefold(), item.id
    labels = [item.answer["topic"] for item in load_tasks(["classification"])[0].items]
    assert min(labels.count(label) for label in set(labels)) >= 5  # every label tested


def test_a_malformed_set_is_refused_naming_the_task(tmp_path: Path) -> None:
    shutil.copy(DATA_DIR / "tasks.json", tmp_path / "tasks.json")
    items = (DATA_DIR / "booking.jsonl").read_text().splitlines()
    (tmp_path / "booking.jsonl").write_text("\n".join(items[: MIN_ITEMS - 1]))
    with pytest.raises(ValueError, match=f"task booking: {MIN_ITEMS - 1} items"):
        load_tasks(["booking"], tmp_path)
    broken = json.loads(items[0]) | {"answer": {"name": "Chen", "guests": "two"}}
    (tmp_path / "booking.jsonl").write_text("\n".join([json.dumps(broken), *items[1:]]))
    with pytest.raises(ValueError, match="booking-00's answer does not match"):
        load_tasks(["booking"], tmp_path)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_tasks(["nope"], tmp_path)


def test_a_json_object_is_found_in_free_text() -> None:
    prose = 'Sure! Here it is:\n```json\n{\n  "name": "Ana {B}",\n  "age": 3\n}\n```\nDone.'
    assert find_json_object(prose) == {"name": "Ana {B}", "age": 3}
    assert find_json_object('{broken {"a": {"b": 1}} tail') == {"a": {"b": 1}}
    assert find_json_object('[1, 2] then {"x": [3]}') == {"x": [3]}
    assert find_json_object('no object, "a": 1 }') is None
    assert find_json_object('{"cut": "short') is None


def test_values_are_normalized_before_they_are_compared() -> None:
    assert normalize("  Maria   Lopez. ") == normalize("maria lopez")
    assert normalize("34") == normalize(34) == normalize(34.0)
    assert normalize("17:30") == "17:30" and normalize("2025-01-01") == "2025-01-01"
    assert normalize("Madrid") != normalize("Madrid, Spain")
    assert normalize(True) is True and normalize(1) != normalize("one")


def test_fields_are_counted_against_the_answer() -> None:
    answer = {"name": "Tom Becker", "age": 52, "city": "Hamburg", "job": "carpenter"}
    got = {"name": "tom becker", "age": "52", "city": "Berlin", "job": "Carpenter."}
    assert fields_right(got, answer) == 3
    assert fields_right({"name": "Tom Becker"}, answer) == 1
    assert fields_right(None, answer) == 0 and fields_right(["Tom Becker"], answer) == 0
    schema = load_tasks(["extraction"])[0].output_schema
    assert is_valid(answer, schema)
    assert not is_valid(got, schema)  # "52" is not an integer: right, but not valid
    assert not is_valid({**answer, "extra": 1}, schema) and not is_valid(None, schema)
    assert is_valid({"any": "object"}, None) and not is_valid("text", None)  # json_object


def test_a_label_is_read_from_a_free_answer() -> None:
    labels = ("sports", "food", "technology", "weather")
    assert read_label("The topic is Sports.", labels) == "sports"
    assert read_label('"food"', labels) == "food"
    assert read_label("It is about sports, food and weather.", labels) is None  # no choice
    assert read_label("A sportsman's breakfast", labels) is None  # words, not substrings


def test_tool_arguments_are_read_from_a_call_written_as_text() -> None:
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert tool_arguments(call, "get_weather") == {"city": "Oslo"}
    assert tool_arguments({"name": "get_weather", "parameters": {"city": "Oslo"}}, "get_weather")
    assert tool_arguments({"city": "Oslo"}, "get_weather") == {"city": "Oslo"}
    assert tool_arguments(None, "get_weather") is None


def test_a_row_counts_valid_right_cut_and_refused_items() -> None:
    task = load_tasks(["tool_weather"], DATA_DIR)[0]
    outcomes: list[Generation | BaseException] = [
        Generation({"city": item.answer["city"]}, "", 6, False) for item in task.items
    ]
    outcomes[0] = Generation({"city": "Nowhere"}, "x", 10, False)  # valid, wrong
    outcomes[1] = Generation(None, "Sorry", 256, True)  # no call, cut
    outcomes[2] = Refused("HTTP 400: json_format")
    row = quality_bench.score(task, outcomes)
    n = len(task.items)
    assert (row["valid"], row["items_right"], row["cut"], row["errors"]) == (n - 2, n - 3, 1, 1)
    assert row["mean_output_tokens"] == pytest.approx((6 * (n - 3) + 10 + 256) / (n - 1))
    assert row["first_error"] == "Refused: HTTP 400: json_format"
    assert row["cut_example"] == f"{task.items[1].id}: ...Sorry"
    assert [e["id"] for e in row["wrong_examples"]] == [task.items[0].id, task.items[1].id]

    labels = load_tasks(["classification"])[0]
    chosen = [Generation(item.answer["topic"], "", None, False) for item in labels.items]
    row = quality_bench.score(labels, list(chosen))
    assert row["items_right"] == row["valid"] == len(labels.items)
    assert row["mean_output_tokens"] is None  # select generates nothing

    booking = load_tasks(["booking"])[0]
    partial = [Generation({"name": item.answer["name"]}, "", 9, False) for item in booking.items]
    assert quality_bench.score(booking, list(partial))["valid"] == 0
    row = quality_bench.score(booking, list(partial), schema_bound=False)
    assert row["valid"] == len(booking.items) and row["fields_right"] == len(booking.items)
    assert row["right_by_field"] == {"name": len(booking.items), "date": 0, "time": 0, "guests": 0}


def test_targets_flag_invalid_or_less_accurate_constrained_rows() -> None:
    def row(valid: int, right: int, constrained: bool = True, errors: int = 0) -> dict[str, Any]:
        return {"constrained": constrained, "items": 32, "valid": valid,
                "items_right": right, "errors": errors}  # fmt: skip

    results = {
        "extraction": {
            "unconstrained": row(30, 20, constrained=False),
            "good": row(32, 19),
            "worse": row(32, 18),
            "invalid": row(31, 25),
            "refused": row(0, 0, errors=32),
        },
        "tool_weather": {"unconstrained": row(0, 0, constrained=False), "few": row(32, 28)},
    }
    missed = quality_bench.check_targets(results)
    assert missed == [
        "extraction / worse: 18 right < unconstrained 20 - 1",
        "extraction / invalid: 31/32 valid",
        "tool_weather / few: 28/32 < 90%",
    ]


def _client(handler: Any) -> Client:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test")
    return Client(http, "m", lambda message: f"<user>{message}", None, 64)  # type: ignore[arg-type]


def test_json_format_unknown_to_the_server_fails_aligned_and_drops_back_for_compact() -> None:
    seen: list[dict[str, Any]] = []

    def old_server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "json_format" in body["sampling_params"]:
            error = "Unrecognized request argument supplied: sampling_params.json_format"
            return httpx.Response(400, json={"error": {"message": error}})
        meta = {"finish_reason": {"type": "stop"}, "completion_tokens": 5}
        return httpx.Response(200, json={"text": '{"city": "Oslo"}', "meta_info": meta})

    task = load_tasks(["tool_weather"])[0]
    aligned = quality_modes.native_json_schema("aligned")
    compact = quality_modes.native_json_schema("compact")
    with pytest.raises(Refused, match="HTTP 400.*json_format"):
        asyncio.run(aligned(_client(old_server), task, task.items[0]))
    seen.clear()
    generation = asyncio.run(compact(_client(old_server), task, task.items[0]))
    assert generation == Generation({"city": "Oslo"}, '{"city": "Oslo"}', 5, False, NO_FIELD_NOTE)
    assert [b["sampling_params"].get("json_format") for b in seen] == ["compact", None]
    assert seen[0]["text"] == f"<user>{task.items[0].text}"


def test_unconstrained_tool_items_ask_for_a_free_envelope_and_read_calls_in_text() -> None:
    """The unconstrained mode on a tool task: tools under auto with ``reply_envelope: "free"``
    (no grammar); a call the server did not parse is read from an envelope after prose."""
    seen: list[dict[str, Any]] = []
    text = 'Sure! {"tool_call": {"name": "get_weather", "arguments": {"city": "Lima"}}} Bye.'

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        message = {"role": "assistant", "content": text}
        choice = {"message": message, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": 9}})

    task = load_tasks(["tool_weather"])[0]
    generation = asyncio.run(quality_modes.unconstrained(_client(server), task, task.items[0]))
    assert generation.value == {"city": "Lima"}
    assert seen[0]["reply_envelope"] == "free" and seen[0]["tool_choice"] == "auto"
    assert "response_format" not in seen[0] and "json_format" not in seen[0]
    other = 'No call: {"tool_call": {"name": "other", "arguments": {"city": "Lima"}}}'
    assert quality_modes.envelope_call_arguments(other, "get_weather") is None
    assert quality_modes.envelope_call_arguments("Lima.", "get_weather") is None


def test_no_call_items_are_right_when_the_reply_answers() -> None:
    """The no_call task: the tool offered under auto, right when the reply does not call
    (a call the server parsed, or one written in an envelope in free text, is a miss)."""
    replies = iter([
        {"content": "Forty-two."},
        {"content": None, "tool_calls": [{"function": {"name": "get_weather", "arguments": "{}"}}]},
        {"content": 'Sure: {"tool_call": {"name": "get_weather", "arguments": {"city": "X"}}}'},
    ])  # fmt: skip

    def server(request: httpx.Request) -> httpx.Response:
        message = {"role": "assistant", **next(replies)}
        choice = {"message": message, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": 3}})

    task = load_tasks(["no_call"])[0]
    assert task.tool is not None and task.tool["name"] == "get_weather"
    modes = {m.name: m for m in quality_modes.all_modes() if "no_call" in m.kinds}
    assert set(modes) == {"unconstrained", "tools auto aligned", "tools auto compact"}
    client, item = _client(server), task.items[0]
    answered = asyncio.run(modes["unconstrained"].run(client, task, item))
    called = asyncio.run(modes["tools auto aligned"].run(client, task, item))
    written = asyncio.run(modes["unconstrained"].run(client, task, item))
    row = quality_bench.score(task, [answered, called, written] + [answered] * 29, True)
    assert [g.value for g in (answered, called, written)] == [{"called": b} for b in (0, 1, 1)]
    assert row["items_right"] == 30 and row["valid"] == 32


def test_arbor_bench_quality_is_the_quality_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "quality", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: arbor bench quality") and "--model-path" in printed
    with pytest.raises(SystemExit):
        main(["bench", "quality", "--tasks"])  # quality_bench's own flags, not the suite's
    assert "--tasks: expected one argument" in capsys.readouterr().err


def test_sampling_fields_reach_every_api_where_it_takes_them() -> None:
    """--sampling: inside sampling_params natively, at the top level of an OpenAI body."""
    seen: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/generate":
            meta = {"finish_reason": {"type": "stop"}, "completion_tokens": 5}
            return httpx.Response(200, json={"text": '{"city": "Oslo"}', "meta_info": meta})
        choice = {"message": {"content": '{"city": "Oslo"}'}, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": 5}})

    task = load_tasks(["tool_weather"])[0]
    client = _client(server)
    client.sampling = {"dry_multiplier": 0.8}
    asyncio.run(quality_modes.native_json_schema("aligned")(client, task, task.items[0]))
    asyncio.run(quality_modes.unconstrained(client, task, task.items[0]))
    assert seen[0]["sampling_params"]["dry_multiplier"] == 0.8
    assert seen[1]["dry_multiplier"] == 0.8
    args = quality_bench.build_parser().parse_args(["--sampling", '{"dry_base": 2.0}'])
    assert args.sampling == {"dry_base": 2.0}
    with pytest.raises(SystemExit):
        quality_bench.build_parser().parse_args(["--sampling", "[1]"])
