"""The Responses API's pieces without a server: items to messages, the output builder and
the store."""

from __future__ import annotations

from array import array

import pytest

from runtime.server.errors import ApiError
from runtime.server.responses_input import items_to_messages, output_to_items
from runtime.server.responses_output import OutputBuilder
from runtime.server.responses_store import ResponseStore, StoredResponse


def _no_refs(item_id: str) -> None:
    return None


def test_calls_join_the_assistant_message_before_them():
    items = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    messages = items_to_messages(items, _no_refs)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "ab"
    assert messages[2]["content"] == "ok"
    assert [c["function"]["name"] for c in messages[2]["tool_calls"]] == ["f", "g"]
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "two"}


def test_a_call_without_a_message_opens_one():
    messages = items_to_messages(
        [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}], _no_refs
    )
    assert messages == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
    ]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ("text", "input.0"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0"),
        ({"role": "user", "content": 7}, "input.0.content"),
        ({"role": "user", "content": []}, "input.0.content"),
        ({"type": "function_call_output", "call_id": "c", "output": "x"}, "input.0.call_id"),
    ],
)
def test_bad_items(item: object, param: str):
    with pytest.raises(ApiError) as info:
        items_to_messages([item], _no_refs)  # type: ignore[list-item]
    assert info.value.param == param


def test_an_output_answers_a_call_of_the_previous_response_or_an_earlier_item():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    earlier = items_to_messages([call], _no_refs)
    answer = {"type": "function_call_output", "call_id": "c1", "output": "one"}
    assert items_to_messages([answer], _no_refs, earlier=earlier)[0]["tool_call_id"] == "c1"
    with pytest.raises(ApiError, match="no function_call with call_id 'c1'") as info:
        items_to_messages([answer, call], _no_refs)  # the call comes after its output
    assert info.value.param == "input.0.call_id"


def _kinds(builder: OutputBuilder) -> list[str]:
    return [event["type"].removeprefix("response.") for event in builder.take_events()]


def test_builder_items_and_events():
    builder = OutputBuilder()
    builder.text("Let me ")
    builder.text("check.")
    builder.call_start("call_1", "f")
    builder.call_arguments('{"a": ')
    builder.call_arguments("1}")
    builder.text("\n")  # between calls: no message
    builder.call_start("call_2", "g")
    builder.call_arguments("{}")
    builder.finish()
    assert [item["type"] for item in builder.items] == ["message", "function_call", "function_call"]
    assert builder.items[0]["content"][0]["text"] == "Let me check."
    assert builder.items[1]["arguments"] == '{"a": 1}'
    assert all(item["status"] == "completed" for item in builder.items)
    kinds = _kinds(builder)
    assert kinds == [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
    ]


def test_builder_event_indexes_and_snapshots():
    builder = OutputBuilder()
    builder.reasoning("hmm")
    builder.text("answer")
    builder.finish("incomplete")
    events = builder.take_events()
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1]
    assert added[1]["item"]["content"] == []  # as it was when sent
    assert builder.items[0]["content"][0]["text"] == "hmm"
    assert builder.items[0]["status"] == "completed"
    assert builder.items[1]["status"] == "incomplete"
    assert all(
        e["item_id"] == builder.items[1]["id"]
        for e in events
        if e["output_index"] == 1 and "item_id" in e
    )


def test_empty_output_is_one_empty_message():
    builder = OutputBuilder()
    builder.text("  ")
    builder.finish()
    assert [item["type"] for item in builder.items] == ["message"]
    assert builder.items[0]["content"][0]["text"] == "  "


def test_output_items_round_trip_as_input():
    builder = OutputBuilder()
    builder.text("hi")
    builder.call_start("call_9", "f")
    builder.call_arguments("{}")
    builder.finish()
    messages = items_to_messages(output_to_items(builder.items), _no_refs)
    assert len(messages) == 1 and messages[0]["content"] == "hi"
    assert messages[0]["tool_calls"][0]["id"] == "call_9"


def _stored(response_id: str, item_id: str) -> StoredResponse:
    return StoredResponse(
        response={"id": response_id, "output": [{"id": f"out-{item_id}"}]},
        input_items=[{"id": item_id}],
        messages=[],
        prompt_text="",
        prompt_ids=array("i"),
        output_ids=array("i"),
        ends_with_stop_token=False,
        answer_index=None,
    )


def test_store_is_bounded_and_indexes_items():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(_stored(f"r{i}", f"i{i}"))
    assert len(store) == 2 and store.get("r0") is None
    assert store.item("i0") is None and store.item("out-i0") is None
    assert store.item("i2") == {"id": "i2"} and store.item("out-i1") == {"id": "out-i1"}
    assert store.delete("r1") and not store.delete("r1")
    assert store.item("i1") is None
