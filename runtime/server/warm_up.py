"""What the server process does between the scheduler's ready and ``/health``'s 200.

A server's first requests paid for work that every later one skips: the chat template's first
render, the first forward of each kind (prefill, decode, prompt logprobs), the first grammar
compile, and under ``tool_choice: "auto"`` in the generic format the tool decision's
calibration (two dozen scoring requests: seconds on a CPU). The warm-up does it all before the
server says ready, with requests of its own through the same tokenizer manager:

1. a chat turn rendered with the chat template and a few tokens generated from it;
2. a few tokens under a tool-call grammar (the structural tag a tools request compiles);
3. the tool decision's thresholds, read back from the cache folder or calibrated and kept
   there (``ToolDecider.prepare``; only for the generic tool-call format);

(``--skip-server-warmup`` leaves out 1 and 2), then it empties the radix cache, so a user's
first request finds it as a fresh server's (the scheduler's counters do count the warm-up's
requests). A failure is logged and the server
serves without the rest of the warm-up. Its phases join the startup log
(``runtime.startup_phases``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime.chat.generic_tools import ReplyEnvelope
from runtime.chat.tool_call_formats import GENERIC_FORMAT
from runtime.chat.tool_calls import calls_or_answer, tool_call_constraint
from runtime.chat.tool_decision import CALIBRATION_TOOLS
from runtime.chat.tool_thresholds import ThresholdStore
from runtime.chat_templates import has_chat_template
from runtime.ipc import ControlCommand
from runtime.sampling_params import SamplingParams
from runtime.server.openai_api import render_prompt
from runtime.server.state import ServerState
from runtime.startup_phases import StartupPhases

logger = logging.getLogger(__name__)

# Tokens each warm-up request generates: a prefill and a few decode steps.
WARM_UP_TOKENS = 4
_MESSAGES = [{"role": "user", "content": "Hello! What is the weather like in Paris today?"}]


class WarmUp:
    """The server process's warm-up; ``done`` once it has run (``/health`` says ready then)."""

    def __init__(self, store: ThresholdStore | None = None) -> None:
        self.done = False
        self.phases = StartupPhases()
        self._store = store if store is not None else ThresholdStore()

    async def run(self, state: ServerState, finished: Callable[[], None]) -> None:
        """Run each step once the scheduler is ready, then call ``finished`` (which logs the
        startup) before ``done`` turns true; never raises."""
        try:
            if not state.args.skip_server_warmup:
                await self._turns(state)
            if state.tool_call_format == GENERIC_FORMAT and has_chat_template(state.tokenizer):
                with self.phases.phase("tool calibration"):
                    await state.tool_decider.prepare(state, self._store)
            flushed = await state.tokenizer_manager.control(ControlCommand.FLUSH_CACHE)
            if not flushed.get("success"):
                logger.info("warm-up: the cache was not emptied (a request is running)")
        except Exception:
            logger.exception("warm-up failed; serving without the rest of it")
        try:
            finished()
        finally:
            self.done = True

    async def _turns(self, state: ServerState) -> None:
        """Steps 1 and 2: a plain turn (a chat turn, or text for a base model with no chat APIs
        to warm) and a constrained one."""
        if not has_chat_template(state.tokenizer):
            with self.phases.phase("warm-up: text"):
                await _text_turn(state, None)
            with self.phases.phase("warm-up: grammar"):
                await _text_turn(state, r"[A-Z][a-z]+\.")
            return
        with self.phases.phase("warm-up: chat"):
            await _chat_turn(state)
        with self.phases.phase("warm-up: grammar"):
            await _constrained_turn(state)


async def _chat_turn(state: ServerState) -> None:
    _, ids = await render_prompt(state, _MESSAGES, None, {})
    await _generate(state, ids, SamplingParams(max_new_tokens=WARM_UP_TOKENS, temperature=0.0))


async def _text_turn(state: ServerState, regex: str | None) -> None:
    """A completion of plain text, as ``/v1/completions`` sends it (under ``regex``, if any)."""
    ids = await state.tokenizer_manager.run_tokenizer(
        lambda: list(state.tokenizer.encode(_MESSAGES[0]["content"])), "prompt"
    )
    params = SamplingParams(max_new_tokens=WARM_UP_TOKENS, temperature=0.0, regex=regex)
    await _generate(state, ids, params)


async def _constrained_turn(state: ServerState) -> None:
    """As a tools request does: the prompt with the tools, under the grammar of a call (the
    reply envelope held to its call side, in the generic format)."""
    functions = list(CALIBRATION_TOOLS.values())
    tools = [{"type": "function", "function": function} for function in functions]
    fmt = state.tool_call_format
    if fmt == GENERIC_FORMAT:
        envelope = ReplyEnvelope(True, scored=True)
        _, ids = await render_prompt(state, _MESSAGES, tools, {}, envelope)
        tag = calls_or_answer(functions, True, fmt, {}, envelope=True, branch="call")
    else:
        _, ids = await render_prompt(state, _MESSAGES, tools, {})
        tag = tool_call_constraint(functions, "required", parallel=True, fmt=fmt)
    params = SamplingParams(max_new_tokens=WARM_UP_TOKENS, temperature=0.0, structural_tag=tag)
    await _generate(state, ids, params)


async def _generate(state: ServerState, ids: list[int], params: SamplingParams) -> Any:
    final = None
    async for output in state.tokenizer_manager.generate(ids, params, stream=True):
        final = output
    return final
