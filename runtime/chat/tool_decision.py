"""The call-or-answer decision of the ``generic`` format under tool_choice "auto", scored.

Under auto a template without tool syntax replies in the reply envelope
(``runtime.chat.generic_tools.ReplyEnvelope``): ``{"tool_call": ...}`` or
``{"response": ...}``. Left to pick the key itself, a small model picks it blind to the
request: SmolLM2-135M-Instruct prefers the call key by about one nat on weather questions and
on requests no tool serves alike, so it called on 28 of 32 weather questions and on 26 of 32
requests that want an answer (docs/benchmarks.md, "the call-or-answer decision examined").
What does follow the request is how likely the model finds a tool's *name* once a call is
opened: log P(``get_weather"`` | the prompt, ``{"tool_call": {"name": "``) averages -7.5 nats
on the weather questions and -12.6 on the others.

So the server decides (``reply_envelope: "scored"``, the default): it scores each offered
tool's name after the call's opening (prefill only, one request a tool, the prompt's KV
shared with the reply through the radix cache) and holds the envelope to the call side when
the best name scores above the model's threshold, else to the answer side (the grammar's
``branch``). The threshold is the model's own, calibrated on the prompts below (written for
this, apart from quality_bench's frozen sets: requests that need one of three tools, and
requests that want an answer, each offered one or two of the tools): the cut between their
scores that classifies most of them, taken when it classifies at least ``MIN_ACCURACY`` of
them. A model whose scores do not separate them (random weights) keeps its own choice of key.
A server sets its thresholds at startup, before it says ready (``ToolDecider.prepare``): read
back from the cache folder where an earlier start kept them (``runtime.chat.tool_thresholds``),
else calibrated and kept there.

The decision is the same for every sample of the request (``n``) and does not sample (the
threshold is a cut, not a probability); a request that must call says ``required``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from runtime.chat.generic_tools import ReplyEnvelope, generic_messages
from runtime.chat.tool_thresholds import (
    NUMERICS_FIELDS,
    Threshold,
    ThresholdStore,
    calibration_digest,
)
from runtime.model_identity import model_identity
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The share of the calibration prompts a threshold must classify to be used.
MIN_ACCURACY = 0.8
# More offered tools than this: the model picks the key itself (one scored sequence per tool).
MAX_SCORED_TOOLS = 32
# The envelope shapes a server calibrates at startup: a list of calls (every API's default for
# parallel tool calls), then a single call.
SHAPES = (True, False)


def call_opening(parallel: bool) -> str:
    """The envelope's text from its start to a call's name, in the compact form the prompt
    shows (``ReplyEnvelope.instruction``)."""
    return '{"tool_calls": [{"name": "' if parallel else '{"tool_call": {"name": "'


def _tool(name: str, description: str, parameter: str, about: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {parameter: {"type": "string", "description": about}},
            "required": [parameter],
        },
    }


CALIBRATION_TOOLS = {
    tool["name"]: tool
    for tool in (
        _tool("get_weather", "Get the current weather in a city.", "city", "The city name"),
        _tool("get_time", "Get the current local time in a city.", "city", "The city name"),
        _tool("get_population", "Look up the population of a country.", "country", "The country"),
    )
}
# (request, the tools offered, whether a call is the right move)
CALIBRATION_PROMPTS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("What is the weather in Paris?", ("get_weather",), True),
    ("Is it raining in London right now?", ("get_weather",), True),
    ("How hot is it in Tokyo today?", ("get_weather",), True),
    ("Tell me the weather forecast for Berlin.", ("get_weather",), True),
    ("I am flying to Madrid. What's the weather like there?", ("get_weather",), True),
    ("What time is it in Sydney?", ("get_time",), True),
    ("Can you tell me the local time in Chicago?", ("get_time",), True),
    ("How many people live in Brazil?", ("get_population",), True),
    ("What is the population of Canada?", ("get_population",), True),
    ("What's the weather in Rome?", ("get_weather", "get_time"), True),
    ("What time is it in Cairo?", ("get_weather", "get_time"), True),
    ("Is it sunny in Lisbon?", ("get_weather", "get_time", "get_population"), True),
    ("Name a famous painting by Van Gogh.", ("get_weather",), False),
    ("How many days are in a leap year?", ("get_time",), False),
    ("Write a one-sentence bedtime story about a dragon.", ("get_population",), False),
    ("What does DNA stand for?", ("get_weather", "get_time"), False),
    ("Is a tomato a fruit or a vegetable?", ("get_weather",), False),
    ("Describe a sunset in five words.", ("get_time",), False),
    ("What rhymes with 'moon'?", ("get_population",), False),
    ("Who painted the Mona Lisa?", ("get_weather", "get_time"), False),
    ("Recommend a board game for four players.", ("get_weather",), False),
    ("What is 9 squared?", ("get_time",), False),
    ("Good night, talk to you tomorrow.", ("get_population",), False),
    ("Explain what a verb is in one sentence.", ("get_weather", "get_time"), False),
)


def choose_threshold(scored: Sequence[tuple[float, bool]], min_accuracy: float) -> Threshold:
    """The cut between ``scored`` (score, a call is right) that classifies most of them
    ("call" above it): the median of the midpoints that tie for best. ``value`` None when the
    best classifies fewer than ``min_accuracy`` of them, or one side has no prompt."""
    if not scored or all(want for _, want in scored) or not any(want for _, want in scored):
        return Threshold(None, 0.0)
    values = sorted({score for score, _ in scored})
    cuts = [values[0] - 1.0] + [(a + b) / 2 for a, b in zip(values, values[1:], strict=False)]

    def right(cut: float) -> int:
        return sum((score > cut) == want for score, want in scored)

    best = max(right(cut) for cut in cuts)
    accuracy = best / len(scored)
    if accuracy < min_accuracy:
        return Threshold(None, accuracy)
    return Threshold(statistics.median(cut for cut in cuts if right(cut) == best), accuracy)


class ToolDecider:
    """One server's decisions: the threshold per envelope shape (single call or a list), set
    at startup by ``prepare`` or, for a shape it did not set, calibrated in the background on
    first use; then a scoring pass per request."""

    def __init__(self) -> None:
        self._thresholds: dict[bool, Threshold] = {}
        self._calibrating: dict[bool, asyncio.Task[None]] = {}
        self._store: ThresholdStore | None = None
        # How each shape's threshold was set (/metrics): "startup" (calibrated before ready),
        # "cache" (read back from the cache folder), "request" (calibrated on first use).
        self.sources: Counter[str] = Counter()

    async def prepare(self, state: Any, store: ThresholdStore | None) -> None:
        """Set every shape's threshold (``SHAPES``) before the server says ready: read from
        ``store`` where an earlier start kept it, else calibrated and kept there (None: not
        kept). Shapes calibrated on demand later are kept in ``store`` too."""
        self._store = store
        for parallel in SHAPES:
            if parallel not in self._thresholds:
                await self._set_threshold(state, parallel, "startup")

    async def decide(
        self,
        state: Any,
        prompt_ids: list[int],
        tool_names: Sequence[str],
        envelope: ReplyEnvelope,
        cache_salt: str | None = None,
    ) -> str | None:
        """ "call" or "answer" for a prompt whose reply is ``envelope``, or None where the model
        picks the key itself (no usable threshold yet, or more than ``MAX_SCORED_TOOLS``
        tools)."""
        if not envelope.scored or not tool_names or len(tool_names) > MAX_SCORED_TOOLS:
            return None
        threshold = self.threshold(state, envelope.parallel)
        if threshold is None or threshold.value is None:
            return None
        try:
            score = await name_score(state, prompt_ids, tool_names, envelope.parallel, cache_salt)
        except Exception as exc:  # e.g. no room left in the context: the reply says so itself
            logger.debug("tool_choice auto: not scored (%s); the model picks the key", exc)
            return None
        return "call" if score > threshold.value else "answer"

    def threshold(self, state: Any, parallel: bool) -> Threshold | None:
        """The shape's threshold; None while it has none, its calibration then started in the
        background (once): the request goes on without waiting for it."""
        known = self._thresholds.get(parallel)
        if known is None and parallel not in self._calibrating:
            self._calibrating[parallel] = asyncio.create_task(
                self._set_threshold(state, parallel, "request")
            )
        return known

    async def _set_threshold(self, state: Any, parallel: bool, source: str) -> None:
        """Read the shape's threshold from the store, else calibrate it (and keep it there);
        a failure leaves the model's own choice of key (no retry)."""
        start = time.perf_counter()
        try:
            prompts = await calibration_prompts(state, parallel)
            store, identity, digest = self._store, "", ""
            if store is not None:
                identity = await asyncio.to_thread(model_identity, state.args.model_path)
                digest = calibration_digest(identity, parallel, prompts, _facts(state, parallel))
            known = store.load(identity, parallel, digest) if store is not None else None
            if known is not None:
                source = "cache"
            else:
                known = await calibrate(state, parallel, prompts)
                if store is not None:
                    await asyncio.to_thread(store.save, identity, parallel, digest, known)
        except Exception as exc:  # the scheduler refused the prompts: no decision
            logger.warning("tool_choice auto: calibration failed: %s", exc)
            known = Threshold(None, 0.0)
        self._thresholds[parallel] = known
        self.sources[source] += 1
        logger.info(
            "tool_choice auto (generic, %s): threshold %s, %.0f%% of the calibration prompts "
            "classified%s (%s, %.2f s)",
            "parallel" if parallel else "one call",
            "none" if known.value is None else f"{known.value:.2f}",
            100 * known.accuracy,
            "" if known.value is not None else "; the model picks the key itself",
            "read from the cache folder" if source == "cache" else f"calibrated at {source}",
            time.perf_counter() - start,
        )


def _facts(state: Any, parallel: bool) -> dict[str, Any]:
    """What a threshold depends on besides the model and the prompts' ids: the calibration's
    constants and the scheduler's numerics (its ``server_info``)."""
    info = state.tokenizer_manager.server_info
    return {
        "offered": [[list(names), want] for _, names, want in CALIBRATION_PROMPTS],
        "opening": call_opening(parallel),
        "min_accuracy": MIN_ACCURACY,
        "numerics": {name: info.get(name) for name in NUMERICS_FIELDS},
    }


async def calibration_prompts(state: Any, parallel: bool) -> list[list[int]]:
    """The calibration prompts' token ids as the server renders them for this shape."""
    tokenizer = state.tokenizer
    envelope = ReplyEnvelope(parallel)

    def render(user: str, names: Sequence[str]) -> list[int]:
        tools = [{"type": "function", "function": CALIBRATION_TOOLS[n]} for n in names]
        messages = generic_messages([{"role": "user", "content": user}], tools, envelope=envelope)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(str(text), add_special_tokens=False).input_ids)

    def render_all() -> list[list[int]]:
        return [render(user, names) for user, names, _ in CALIBRATION_PROMPTS]

    return list(await state.tokenizer_manager.run_tokenizer(render_all, "tool calibration"))


async def calibrate(state: Any, parallel: bool, prompts: Sequence[list[int]]) -> Threshold:
    """Score the calibration prompts (``calibration_prompts``) and choose the threshold."""
    scores = await asyncio.gather(
        *(
            name_score(state, ids, names, parallel)
            for ids, (_, names, _) in zip(prompts, CALIBRATION_PROMPTS, strict=True)
        )
    )
    wanted = [want for _, _, want in CALIBRATION_PROMPTS]
    return choose_threshold(list(zip(scores, wanted, strict=True)), MIN_ACCURACY)


async def name_score(
    state: Any,
    prompt_ids: list[int],
    tool_names: Sequence[str],
    parallel: bool,
    cache_salt: str | None = None,
) -> float:
    """The best of ``tool_names``' log-probabilities after the prompt and the call's opening,
    log P(name + '"' | prompt, opening), read as prompt logprobs of one prefill-only request per
    name (the prompt's KV cached once, under ``cache_salt``): only the name's tokens where the
    opening's tokens begin the tokenized call, else log P(opening + name) - log P(opening)."""
    tokenizer = state.tokenizer
    opening = call_opening(parallel)

    def encode() -> tuple[list[int], list[list[int]]]:
        # Each name as the grammar writes it: a JSON string (the opening holds its quote).
        calls = [opening[:-1] + json.dumps(name, ensure_ascii=False) for name in tool_names]
        head = list(tokenizer(opening, add_special_tokens=False).input_ids)
        return head, [list(tokenizer(c, add_special_tokens=False).input_ids) for c in calls]

    head, calls = await state.tokenizer_manager.run_tokenizer(encode, "tools")
    shared = [call[: len(head)] == head and len(call) > len(head) for call in calls]
    sums = await asyncio.gather(
        *(
            _logprob(state, prompt_ids + call[: len(head)], call[len(head) :], cache_salt)
            if whole
            else _logprob(state, prompt_ids, call, cache_salt)
            for call, whole in zip(calls, shared, strict=True)
        )
    )
    if all(shared):
        return max(sums)
    opening_logprob = await _logprob(state, prompt_ids, head, cache_salt)
    return max(
        total if whole else total - opening_logprob
        for total, whole in zip(sums, shared, strict=True)
    )


_SCORING = SamplingParams(max_new_tokens=1, temperature=0.0)


async def _logprob(
    state: Any, context: list[int], continuation: list[int], cache_salt: str | None
) -> float:
    """log P(continuation | context), from the prompt logprobs of one prefill-only request."""
    ids = context + continuation
    final = None
    async for output in state.tokenizer_manager.generate(
        ids,
        _SCORING,
        return_logprob=True,
        logprob_start_len=len(context),
        stream=False,
        cache_salt=cache_salt,
    ):
        final = output
    entries = (final.input_logprobs if final is not None else None) or []
    return float(sum(entry[0] for entry in entries[-len(continuation) :] if entry[0] is not None))
