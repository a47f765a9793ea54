"""Reasoning parsers: split a reasoning model's output into its thinking and its answer.

Reasoning models think between ``<think>`` and ``</think>``, then answer. ``--reasoning-parser``
names how the model opens that block (``REASONING_FORMATS``):

- ``qwen3``: the model opens it itself (Qwen3's template leaves the generation prompt open when
  thinking is enabled), or does not think at all: an output that does not begin with
  ``<think>`` (whitespace aside) is all answer.
- ``deepseek-r1``: the template opened it in the prompt, so the output starts inside the
  reasoning and the answer begins after ``</think>`` (a ``<think>`` the model writes itself at
  the start is dropped, as older R1 templates left that to the model).

For both, a prompt that ends with a tag (whitespace aside) decides first: ``<think>`` means the
output starts inside the reasoning, ``</think>`` (Qwen3's template with
``enable_thinking=False``) that it is all answer.

The reasoning is the exact text between the tags; the answer is what follows ``</think>``,
from its first non-whitespace character. A block the output never closes (``max_tokens``
reached) is all reasoning, with an empty answer.

Incremental use (chat streaming, Responses events)::

    parser = make_reasoning_parser("qwen3", prompt_text)
    for piece in pieces:
        delta = parser.feed(piece)      # ReasoningDelta(reasoning="...", content="...")
    delta = parser.finish()             # what was held back (or feed(last, final=True))

Text that may be the start of a tag is held back until a later piece (or ``finish``) decides
it, so tags split across pieces at any character are found. ``parser.parse(text)`` splits a
whole output at once. ``constrain_after_reasoning`` makes a request's constraint apply to the
answer only; ``runtime.chat.plan.require_reasoning`` does that for the native API
(``/generate`` and ``Engine.generate``), whose outputs a ``TurnReader`` splits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from runtime.sampling_params import SamplingParams

Phase = Literal["opening", "reasoning", "answer"]
# Prompt tokens decoded to find where an output starts (only the prompt's end decides).
_PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its reasoning."""

    start_tag: str
    end_tag: str
    # Where an output starts when the prompt does not say: inside the reasoning (the template
    # opened it), or in the answer unless the output opens the block itself.
    starts_inside: bool

    def prompt_phase(self, prompt: str) -> Phase | None:
        """Where an output continuing ``prompt`` starts, if the prompt's end says so."""
        tail = prompt.rstrip()
        if tail.endswith(self.end_tag):
            return "answer"
        if tail.endswith(self.start_tag):
            return "reasoning"
        return None


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_inside=False),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", starts_inside=True),
}


@dataclass(frozen=True)
class ReasoningDelta:
    """New text of each part: ``reasoning`` (the thinking) and ``content`` (the answer)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one output, fed in pieces, into reasoning and answer (see the module doc).

    ``phase``: "opening" (nothing decided yet: the output may open a block), "reasoning", or
    "answer" (the reasoning is over, or there was none). ``has_reasoning``: whether the output
    has a reasoning part (it opened a block, or started inside one).
    """

    def __init__(self, fmt: ReasoningFormat, prompt: str = "") -> None:
        self.format = fmt
        decided = fmt.prompt_phase(prompt)
        # Where an output that does not open with the start tag goes.
        self._fallback: Phase = decided or ("reasoning" if fmt.starts_inside else "answer")
        self.phase: Phase = "answer" if decided == "answer" else "opening"
        self.has_reasoning = False
        self._buffer = ""
        self._answer_started = False

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """The reasoning and answer text that ``text`` completes (possibly both empty).
        ``final``: the output ends with ``text``, so nothing is held back."""
        self._buffer += text
        return self._drain(final)

    def finish(self) -> ReasoningDelta:
        """Release what was held back: the output has ended."""
        return self._drain(final=True)

    def parse(self, text: str) -> ReasoningDelta:
        """Split a whole output (on a fresh parser)."""
        return self.feed(text, final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        fmt = self.format
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.phase == "opening":
                stripped = self._buffer.lstrip()
                if stripped.startswith(fmt.start_tag):
                    self._buffer = stripped[len(fmt.start_tag) :]
                    self._enter("reasoning")
                    continue
                if not final and fmt.start_tag.startswith(stripped):
                    break  # blank so far, or a prefix of the start tag
                self._enter(self._fallback)
            elif self.phase == "reasoning":
                end = self._buffer.find(fmt.end_tag)
                if end >= 0:
                    reasoning.append(self._buffer[:end])
                    self._buffer = self._buffer[end + len(fmt.end_tag) :]
                    self.phase = "answer"
                    continue
                keep = 0 if final else _partial_tag_len(self._buffer, fmt.end_tag)
                reasoning.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            else:
                if not self._answer_started:
                    self._buffer = self._buffer.lstrip()
                    self._answer_started = bool(self._buffer)
                content.append(self._buffer)
                self._buffer = ""
                break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.has_reasoning = self.has_reasoning or phase == "reasoning"


def make_reasoning_parser(name: str, prompt: str = "") -> ReasoningParser:
    """A parser for one output of the format ``name`` (a key of REASONING_FORMATS) continuing
    ``prompt`` (the rendered chat prompt; its end may decide where the output starts)."""
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_FORMATS)}"
        )
    return ReasoningParser(fmt, prompt)


def constrain_after_reasoning(
    name: str, tokenizer: Any, sampling: SamplingParams
) -> SamplingParams:
    """``sampling`` with its constraint (if any) starting after the reasoning of format
    ``name``: ``reasoning_end_token_id`` (and, for a model that may or may not open the block,
    ``reasoning_start_token_id``) set to the tags' token ids (runtime/scheduler/reasoning_gate.py).
    ValueError when the tags are not single tokens of ``tokenizer``."""
    if not sampling.has_grammar:
        return sampling
    fmt = REASONING_FORMATS[name]
    start, end = reasoning_token_ids(name, tokenizer)
    if end is None or (start is None and not fmt.starts_inside):
        tags = fmt.end_tag if fmt.starts_inside else f"{fmt.start_tag} and {fmt.end_tag}"
        raise ValueError(
            f"a constraint with --reasoning-parser {name} starts after the reasoning, which "
            f"needs {tags} to be single tokens of this model's tokenizer"
        )
    return dataclasses.replace(
        sampling,
        reasoning_end_token_id=end,
        reasoning_start_token_id=None if fmt.starts_inside else start,
    )


def reasoning_token_ids(name: str, tokenizer: Any) -> tuple[int | None, int | None]:
    """(start, end) token ids of the format's tags in ``tokenizer``; None for a tag that is
    not one token (a constraint cannot then start after the reasoning)."""
    fmt = REASONING_FORMATS[name]
    return _single_token(tokenizer, fmt.start_tag), _single_token(tokenizer, fmt.end_tag)


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids[0] if len(ids) == 1 else None


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
