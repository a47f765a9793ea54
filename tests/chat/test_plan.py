"""Planning a turn once for every API (runtime/chat/plan.py), on a stand-in host."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.chat.generated_turns import GeneratedTurns
from runtime.chat.generic_tools import ReplyEnvelope
from runtime.chat.plan import Prompt, plan_turn, turn_envelope
from runtime.chat.turn_spec import ToolChoice, TurnSpec
from runtime.errors import RequestError
from runtime.ipc import FinishReason, PinPrefix
from runtime.request_checks import InvalidRequestValue
from runtime.sampling_params import RequestLimits
from runtime.tokenizer_manager import RequestOutput

# What the stand-in host's tokenizer manager was asked to pin (``PinPrefix``).
PINNED: list[PinPrefix] = []
WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}
TIME = {"name": "get_time", "parameters": {"type": "object"}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


@dataclass
class Decider:
    branch: str | None = None
    asked: list[Any] = field(default_factory=list)

    async def decide(self, host: Any, ids: Any, names: Any, envelope: Any, salt: Any) -> Any:
        self.asked.append((list(names), envelope, salt))
        return self.branch


def _host(fmt: str = "hermes", branch: str | None = None, context: int = 100) -> Any:
    return SimpleNamespace(
        tokenizer=None,
        tokenizer_manager=SimpleNamespace(
            limits=RequestLimits(vocab_size=1000), pin_prefix=PINNED.append
        ),
        tool_call_format=fmt,
        tool_decider=Decider(branch),
        generated_turns=GeneratedTurns(None),
        args=SimpleNamespace(reasoning_parser=None, tool_wait_ttl=30.0),
        context_length=context,
    )


def _spec(mode: str = "auto", **fields: Any) -> TurnSpec:
    names = frozenset({"get_weather"} if mode == "named" else {"get_weather", "get_time"})
    base: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": ToolChoice(mode, names),  # type: ignore[arg-type]
        "sampling": {"max_new_tokens": 8},
        "param_names": {"max_new_tokens": "max_tokens", "answer": "response_format"},
    }
    return TurnSpec(**(base | fields))


def _plan(spec: TurnSpec, host: Any, prompt_len: int = 10) -> Any:
    shown: list[Any] = []

    async def render(tools: Any, envelope: ReplyEnvelope | None) -> Prompt:
        shown.append((tools, envelope))
        return Prompt("prompt", list(range(prompt_len)))

    plan = asyncio.run(plan_turn(spec, host, render))
    return plan, shown


def test_forced_calls_constrain_and_show_the_tools() -> None:
    plan, shown = _plan(_spec("named", answer={"json_schema": SCHEMA}), _host())
    tag = plan.sampling.structural_tag
    assert tag["mode"] == "named" and tag["name"] == "get_weather"
    assert [tool["name"] for tool in tag["tools"]] == ["get_weather"]
    assert plan.sampling.json_schema is None  # the format is for a later turn
    assert shown == [([WEATHER, TIME], None)]


def test_auto_with_a_format_is_calls_or_an_answer_and_none_hides_the_tools() -> None:
    plan, _ = _plan(_spec("auto", answer={"json_schema": SCHEMA}), _host())
    assert plan.sampling.structural_tag["answer"] == SCHEMA
    plan, shown = _plan(_spec("none", answer={"json_schema": SCHEMA}), _host())
    assert plan.sampling.structural_tag is None and plan.sampling.json_schema == SCHEMA
    assert shown == [(None, None)]
    reader = plan.reader()
    assert reader.tools is None and reader.reasoning is None


def test_generic_auto_is_the_envelope_held_to_the_decided_branch() -> None:
    host = _host("generic", branch="answer")
    plan, shown = _plan(_spec("auto", cache_salt="s"), host)
    envelope = shown[0][1]
    assert envelope is not None and envelope.constrained and envelope.scored
    assert plan.sampling.structural_tag["branch"] == "answer"
    assert host.tool_decider.asked == [(["get_weather", "get_time"], envelope, "s")]
    # The request's own grammar: no envelope (its free text is read in the call syntax).
    assert turn_envelope(_spec("auto", sampling={"regex": "a+"}), "generic") is None


def test_errors_name_the_apis_fields() -> None:
    with pytest.raises(InvalidRequestValue, match="max_tokens") as room:
        _plan(_spec("none", output_limit=95), _host(context=100))
    assert room.value.field == "max_tokens"
    with pytest.raises(RequestError) as bad:
        _plan(_spec("none", sampling={"max_new_tokens": 8, "temperature": -1.0}), _host())
    assert bad.value.param == "temperature"
    with pytest.raises(RequestError) as free:
        _plan(_spec("auto", answer={"json_object": True}, reply_envelope="free"), _host("generic"))
    assert free.value.param == "reply_envelope"


def _finish(plan: Any, text: str) -> None:
    """Read ``text`` as the whole output of one choice of ``plan``'s turn."""
    final = RequestOutput("r", text, text, [7, 8, 9], 10, 3, 0, FinishReason.stop(None), 0.0)
    plan.reader().read_whole(final)


def test_only_a_turn_that_ended_in_tool_calls_is_pinned_for_the_tool_wait() -> None:
    plan, _ = _plan(_spec("auto", cache_salt="s"), _host())
    assert plan.pin is None  # nothing is pinned as the request finishes
    PINNED.clear()
    _finish(plan, "It is sunny in Paris.")
    assert PINNED == []  # a plain-text answer
    _finish(plan, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert PINNED == [PinPrefix([*range(10), 7, 8, 9], 30.0, "s")]
    PINNED.clear()
    _finish(plan, '<tool_call>{"name": "get_weath')  # a call cut off: no whole call
    assert PINNED == []


def test_no_tool_wait_without_tools_or_with_a_zero_ttl() -> None:
    host = _host()
    host.args.tool_wait_ttl = 0.0
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    for plan in (_plan(_spec("auto"), host)[0], _plan(_spec("none"), _host())[0]):
        PINNED.clear()
        _finish(plan, call)
        assert PINNED == []
