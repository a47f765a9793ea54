"""A constraint applied otherwise than asked (JSON that could not be aligned) is reported with
the final output: ``meta_info["grammar_notes"]`` natively, ``grammar_notes`` on an OpenAI
choice; nothing is added when there is no note."""

from __future__ import annotations

from runtime.ipc import FinishReason
from runtime.server.openai_format import finish_fields
from runtime.tokenizer_manager import RequestOutput

NOTE = "json_format aligned is not available for this schema: x; the output is compact JSON"


def _output(notes: tuple[str, ...]) -> RequestOutput:
    reason = FinishReason.stop(0)
    return RequestOutput("r", "{}", "", [1, 0], 1, 2, 0, reason, 0.0, grammar_notes=notes)


def test_native_meta_info_carries_the_notes() -> None:
    assert _output((NOTE,)).to_dict()["meta_info"]["grammar_notes"] == [NOTE]
    assert "grammar_notes" not in _output(()).to_dict()["meta_info"]


def test_openai_choice_carries_the_notes() -> None:
    assert finish_fields(_output((NOTE,)))["grammar_notes"] == [NOTE]
    assert "grammar_notes" not in finish_fields(_output(()))
