"""Token ids to text, incrementally: UTF-8 safe, stop strings held back while streaming and trimmed.

Each request decodes a sliding window (a few tokens of context plus the new ones) so the cost
per token stays constant, emits only complete characters (a byte-level BPE token may end in
the middle of a multi-byte character), and never shows a client the start of a stop string
that may turn out to end the output.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

from runtime.channels import Receiver, Sender
from runtime.incremental_decoder import IncrementalDecoder
from runtime.ipc import (
    FinishReason,
    TextOutput,
    TextOutputBatch,
    TokenOutput,
    TokenOutputBatch,
)

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Per-request decoding state. A request whose decoding raises fails alone: its caller
    gets a 500 (``detokenizer_failed`` tells the tokenizer manager to abort it), its later
    outputs are dropped, and only its final one is passed on, so its id is released."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._emitted: dict[str, int] = {}  # characters of ``text`` already sent per request
        self._failed: set[str] = set()  # failed here, still running in the scheduler

    def process(self, batch: TokenOutputBatch) -> TextOutputBatch:
        outputs = []
        for out in batch.outputs:
            if out.rid in self._failed:
                if out.finished_reason is not None:
                    self._failed.discard(out.rid)
                    outputs.append(_text_output(out, "", logprobs=False))
                continue
            try:
                outputs.append(self._process_one(out))
            except Exception:
                logger.exception("detokenizing request %s failed", out.rid)
                outputs.append(self._fail(out))
        return TextOutputBatch(outputs)

    def _fail(self, out: TokenOutput) -> TextOutput:
        self._decoders.pop(out.rid, None)
        self._emitted.pop(out.rid, None)
        still_running = out.finished_reason is None
        if still_running:
            self._failed.add(out.rid)
        failed = _text_output(out, "", logprobs=False)
        failed.finished_reason = FinishReason.error(
            500, "internal error while detokenizing this request; the server log has details"
        )
        failed.detokenizer_failed = still_running
        return failed

    def _process_one(self, out: TokenOutput) -> TextOutput:
        decoder = self._decoders.get(out.rid)
        if decoder is None:
            decoder = self._decoders[out.rid] = IncrementalDecoder(
                self.tokenizer,
                out.prompt_tail_ids or [],
                out.skip_special_tokens,
                out.spaces_between_special_tokens,
            )
        finished = out.finished_reason is not None
        decoder.add(out.new_token_ids, final=finished)
        text = decoder.text
        emitted = self._emitted.get(out.rid, 0)
        if finished:
            end = _trimmed_end(text, emitted, out) if not out.no_stop_trim else len(text)
            del self._decoders[out.rid]
            self._emitted.pop(out.rid, None)
        else:
            end = len(text) - _held_back(text, out.stop)
            self._emitted[out.rid] = max(emitted, end)
        return _text_output(out, text[emitted:end] if end > emitted else "")

    def event_loop(self, inbox: Receiver, outbox: Sender) -> None:
        """Forward every TokenOutputBatch as a TextOutputBatch until a None message arrives."""
        while True:
            message = inbox.recv(timeout=None)
            if message is None:
                return
            if isinstance(message, TokenOutputBatch):
                outbox.send(self.process(message))
            else:
                outbox.send(message)  # anything else is for the tokenizer manager as is


# What a TextOutput carries over from its TokenOutput as is: every field the two share.
_CARRIED = tuple(
    f.name for f in fields(TextOutput) if f.name in {g.name for g in fields(TokenOutput)}
)


def _text_output(out: TokenOutput, text_delta: str, logprobs: bool = True) -> TextOutput:
    """``out`` as the tokenizer manager gets it, with ``text_delta`` (and its logprobs, unless
    the request failed here)."""
    text = TextOutput(text_delta=text_delta, **{name: getattr(out, name) for name in _CARRIED})
    if not logprobs:
        text.output_logprobs, text.input_logprobs = [], None
    return text


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that could begin a stop string."""
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if stop.startswith(text[-n:]):
                held = n
                break
    return held


def _trimmed_end(text: str, emitted: int, out: TokenOutput) -> int:
    """Where the final text ends: before the stop string or stop regex match that ended it."""
    reason = out.finished_reason
    matched = reason.matched if reason is not None else None
    if reason is None or reason.type != "stop" or not isinstance(matched, str):
        return len(text)
    if matched in out.stop:
        pos = text.find(matched, emitted)
        return pos if pos >= 0 else len(text)
    if out.stop_regex:
        # The scheduler stopped at the match that ends first; every occurrence of the matched
        # text is a match, so that one is the text's first occurrence.
        pos = text.find(matched)
        return max(pos, emitted) if pos >= 0 else len(text)
    return len(text)
