"""The whole members of a cut-off JSON object (a tool call's arguments at max_tokens)."""

from __future__ import annotations

import pytest

from runtime.chat.partial_json import complete_prefix_object


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"city": "Paris", "unit": "cel', {"city": "Paris"}),
        ('{"city": "Paris", "unit"', {"city": "Paris"}),
        ('{"city": "Paris", ', {"city": "Paris"}),
        ('{"n": 12', {}),  # the number may go on: 120
        ('{"n": 12,', {"n": 12}),
        ('{"n": 12 ', {"n": 12}),
        ('{"ok": tru', {}),
        ('{"ok": true}', {"ok": True}),
        ('{"a": 1, "b": [1, 2', {"a": 1}),  # a cut array is dropped whole
        ('{"a": {"x": 1}, "b": {"y": ', {"a": {"x": 1}}),
        ('{"a": [{"b": "}"}], "z": nul', {"a": [{"b": "}"}]}),  # brackets inside strings
        ('{"q": "say \\"hi\\"", "r": "x', {"q": 'say "hi"'}),  # escaped quotes
        ('  {"k": "v"} and then text', {"k": "v"}),
        ('{"k', {}),
        ("", {}),
        ("[1, 2]", {}),  # not an object
        ("{", {}),
    ],
)
def test_members_written_whole_are_kept(text: str, expected: dict[str, object]) -> None:
    assert complete_prefix_object(text) == expected


def test_a_long_cut_object_keeps_every_whole_member() -> None:
    members = [f'"k{i}": {i}' for i in range(200)]
    text = "{" + ", ".join(members) + ', "last": "unfinis'
    assert complete_prefix_object(text) == {f"k{i}": i for i in range(200)}
