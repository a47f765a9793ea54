"""Planning one turn: from a ``TurnSpec`` to the prompt and sampling params the runtime runs.

``plan_turn`` is the one place that decides, for every API:

1. the reply envelope (the ``generic`` format under tool_choice auto, unless the request's own
   grammar shapes the output: ``runtime.chat.generic_tools.reply_envelope``);
2. the constraint: forced calls, calls or an answer, or the answer format alone
   (``runtime.chat.tool_calls.turn_constraint``);
3. the sampling params, validated;
4. the prompt (rendered by the caller's ``render``, which the envelope shapes) and the output
   room it leaves;
5. the scored call-or-answer decision (``runtime.chat.tool_decision``);
6. with a reasoning parser, the constraint starting after the reasoning (not in a continued
   answer, which the model writes past its reasoning);
7. a continued final assistant message (``runtime.chat.continuation``): checked, and its
   prefill fed to the constraint before the output (``grammar_prefix_len``).

Errors are ``RequestError``s (a 400) naming the field as the API spells it
(``TurnSpec.param_names``). The server's pieces come in through ``TurnHost`` (the server state
fits it) and ``render``; nothing here knows HTTP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from runtime.chat.continuation import check_continuable
from runtime.chat.generated_turns import GeneratedTurns
from runtime.chat.generic_tools import ReplyEnvelope, reply_envelope
from runtime.chat.reasoning import (
    constrain_after_reasoning,
    make_reasoning_parser,
    reasoning_token_ids,
)
from runtime.chat.tool_call_formats import GENERIC_FORMAT
from runtime.chat.tool_calls import make_tool_parser, turn_constraint
from runtime.chat.tool_decision import ToolDecider
from runtime.chat.turn_reader import TurnReader
from runtime.chat.turn_spec import TurnSpec
from runtime.errors import RequestError
from runtime.generate_input import LogprobOptions, SubRequest, expand
from runtime.ipc import CachePin, PinPrefix
from runtime.request_checks import InvalidRequestValue, check_output_room
from runtime.sampling_params import GRAMMAR_FIELDS, InvalidSamplingParams, SamplingParams
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import RequestOutput, TokenizerManager


class RenderedPrompt(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def ids(self) -> list[int]: ...

    @property
    def prefill_len(self) -> int:
        """The prompt's last tokens that are the continued answer's prefill."""
        ...


P = TypeVar("P", bound=RenderedPrompt)
# (the tools to show, as function definitions, or None; the reply envelope) -> the prompt
Render = Callable[[list[dict[str, Any]] | None, ReplyEnvelope | None], Awaitable[P]]


class TurnHost(Protocol):
    """What planning needs from the process that serves the turn."""

    tokenizer: Any
    tokenizer_manager: TokenizerManager
    tool_call_format: str
    tool_decider: ToolDecider
    generated_turns: GeneratedTurns
    args: ServerArgs

    @property
    def context_length(self) -> int: ...


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    prefill_len: int = 0


@dataclass(frozen=True)
class TurnPlan(Generic[P]):
    """A planned turn: ``prompt`` and ``sampling`` to run; what reading its output needs."""

    spec: TurnSpec
    prompt: P
    sampling: SamplingParams
    tool_call_format: str
    reasoning_parser: str | None
    reasoning_end_token_id: int | None
    turns: GeneratedTurns
    envelope: ReplyEnvelope | None = None
    tool_wait_s: float = 0.0  # --tool-wait-ttl
    # Where a turn that ended in tool calls asks for its tool-wait pin (the tokenizer
    # manager's ``pin_prefix``); None: nowhere.
    pin_prefix: Callable[[PinPrefix], None] | None = None

    def reader(self, turn_id: Callable[[str], str] = str) -> TurnReader:
        """A fresh reader of one output (one per choice); ``turn_id``: the id a call's turn
        is remembered under (the API's id of the call)."""
        spec = self.spec
        tools = None
        if spec.tools_on:
            names = set(spec.tool_choice.names)
            forced = spec.tool_choice.forced
            tools = make_tool_parser(self.tool_call_format, names, spec.max_tool_calls, forced)
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = make_reasoning_parser(self.reasoning_parser, self.prompt.text)
        on_calls = self._pin_for_tools if self.tool_wait_s > 0 and tools is not None else None
        return TurnReader(
            tools, reasoning, self.turns, self.reasoning_end_token_id, turn_id, on_calls
        )

    def _pin_for_tools(self, final: RequestOutput) -> None:
        """The tool wait: a choice that ended in tool calls keeps its prompt and output
        pinned for ``tool_wait_s``, so the next turn (this conversation and the tools'
        results) finds them cached however long the tools run. The server decides it, as only
        it reads the calls (``PinPrefix``); a turn that answered in text pins nothing."""
        if self.pin_prefix is not None:
            ids = [*self.prompt.ids, *final.output_ids]
            self.pin_prefix(PinPrefix(ids, self.tool_wait_s, self.spec.cache_salt))

    @property
    def pin(self) -> CachePin | None:
        """What of the turn's KV stays pinned after it: for the cache hint's
        ``spec.pin_ttl_s``, the whole prompt (which holds every part the client marked); None
        without a hint. (The tool wait is pinned once the calls are read: ``reader``.)"""
        ttl_s = self.spec.pin_ttl_s or 0.0
        return CachePin(ttl_s, len(self.prompt.ids)) if ttl_s else None

    def sub_requests(self, logprobs: LogprobOptions) -> list[SubRequest]:
        """The turn's runs: one per sample (``sampling.n``), under the turn's cache salt,
        routing key and pin."""
        spec = self.spec
        return expand(
            [self.prompt.ids],
            [self.sampling],
            logprobs=logprobs,
            cache_salt=spec.cache_salt,
            routing_key=spec.routing_key,
            pin=self.pin,
        )


async def plan_turn(spec: TurnSpec, host: TurnHost, render: Render[P]) -> TurnPlan[P]:
    """Plan ``spec`` on ``host`` (see the module doc); ``render`` renders its prompt."""
    fmt = host.tool_call_format
    if spec.continue_final:
        check_continuable(spec)
    envelope = turn_envelope(spec, fmt)
    held = envelope is not None and envelope.constrained
    sampling = checked_sampling(spec, _constraint(spec, fmt, held), host.tokenizer_manager)
    prompt = await render(spec.tools if spec.tools_on else None, envelope)
    if spec.output_limit is not None:
        field = spec.param("max_new_tokens")
        check_output_room(len(prompt.ids), spec.output_limit, host.context_length, field)
    if prompt.prefill_len and sampling.has_grammar:
        sampling = dataclasses.replace(sampling, grammar_prefix_len=prompt.prefill_len)
    if held and envelope is not None:  # the server decides call or answer (tool_decision)
        names = [tool["name"] for tool in spec.callable_tools]
        decider = host.tool_decider
        branch = await decider.decide(host, prompt.ids, names, envelope, spec.cache_salt)
        if branch is not None:
            decided = _constraint(spec, fmt, held, branch)
            sampling = dataclasses.replace(sampling, structural_tag=decided["structural_tag"])
    reasoning = host.args.reasoning_parser
    end_token = None
    if reasoning is not None and not spec.continue_final:
        sampling = after_reasoning(spec, reasoning, host.tokenizer, sampling)
        end_token = reasoning_token_ids(reasoning, host.tokenizer)[1]
    return TurnPlan(
        spec,
        prompt,
        sampling,
        fmt,
        reasoning,
        end_token,
        host.generated_turns,
        envelope,
        host.args.tool_wait_ttl,
        host.tokenizer_manager.pin_prefix,
    )


def turn_envelope(spec: TurnSpec, fmt: str) -> ReplyEnvelope | None:
    """The reply envelope of ``spec`` in tool-call format ``fmt``: under tool_choice auto in
    the generic format, unless the request's own grammar shapes the output (its free text is
    then read in the generic call syntax), and none in a continued answer (read the same
    way)."""
    own_grammar = any(name in GRAMMAR_FIELDS for name in spec.sampling) or spec.continue_final
    if spec.tools_on and spec.tool_choice.mode == "auto" and fmt == GENERIC_FORMAT:
        if not own_grammar:
            return reply_envelope(spec.parallel, not spec.answer, spec.reply_envelope)
    return None


def _constraint(
    spec: TurnSpec, fmt: str, envelope: bool, branch: str | None = None
) -> dict[str, Any]:
    choice = spec.tool_choice
    name = next(iter(choice.names)) if choice.mode == "named" else None
    tools = spec.callable_tools
    mode = choice.mode if spec.tools_on else "none"
    return turn_constraint(tools, mode, name, spec.parallel, fmt, spec.answer, envelope, branch)


def checked_sampling(
    spec: TurnSpec, constraint: dict[str, Any], manager: TokenizerManager
) -> SamplingParams:
    """The turn's sampling params with ``constraint``, validated; RequestError naming the
    field as the API spells it (a constraint set twice, or a bad value)."""
    params = dict(spec.sampling)
    for name, value in constraint.items():
        if name in params:
            raise RequestError(f"{name} conflicts with another constraint", param=name)
        params[name] = value
    return sampling_params(params, manager, spec.param_names)


def sampling_params(
    params: dict[str, Any], manager: TokenizerManager, names: Mapping[str, str]
) -> SamplingParams:
    """``params`` validated; RequestError naming the field as the API spells it (``names``:
    sampling param -> request field, where they differ)."""
    try:
        return SamplingParams.from_dict(params, manager.limits)
    except InvalidSamplingParams as exc:
        name = names.get(exc.field, exc.field)
        reason = str(exc).split(": ", 1)[-1]
        raise RequestError(f"{name}: {reason}", param=name) from None


def after_reasoning(
    spec: TurnSpec, name: str, tokenizer: Any, sampling: SamplingParams
) -> SamplingParams:
    """With reasoning parser ``name``, a constraint applies to the answer after the reasoning;
    RequestError naming the constraint (``tool_choice``, or the answer format's field) when
    the model's tags cannot mark where it starts."""
    try:
        return constrain_after_reasoning(name, tokenizer, sampling)
    except ValueError as exc:
        field = "tool_choice" if sampling.structural_tag is not None else "answer"
        raise RequestError(str(exc), param=spec.param(field)) from None


# Prompt tokens decoded to find where a native output starts (only the prompt's end decides).
_PROMPT_TAIL_TOKENS = 16


def require_reasoning(name: str | None, tokenizer: Any, subs: list[SubRequest]) -> list[TurnReader]:
    """The native API's ``require_reasoning`` (``/generate``, ``Engine.generate``): each
    sub-request's constraint, if any, starts after the reasoning of format ``name`` (the
    ``--reasoning-parser``; ``subs`` are changed in place), and one ``TurnReader`` per
    sub-request splits its output (``native_result``). InvalidRequestValue (a 400) without a
    reasoning parser, or when a constraint cannot wait for tags that are not single tokens."""
    if name is None:
        raise InvalidRequestValue(
            "require_reasoning", "needs a reasoning parser (--reasoning-parser)"
        )
    readers = []
    for i, sub in enumerate(subs):
        try:
            sampling = constrain_after_reasoning(name, tokenizer, sub.sampling)
        except ValueError as exc:
            raise InvalidRequestValue("require_reasoning", str(exc)) from None
        subs[i] = dataclasses.replace(sub, sampling=sampling)
        prompt_tail = tokenizer.decode(sub.input_ids[-_PROMPT_TAIL_TOKENS:])
        readers.append(TurnReader(reasoning=make_reasoning_parser(name, prompt_tail)))
    return readers
