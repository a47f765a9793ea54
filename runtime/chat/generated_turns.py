"""The token ids of assistant turns this server generated, so that a conversation re-sent with
them follows the radix cache's path.

A chat template renders a re-sent assistant turn from its text, and tokenizing that text need
not give back the ids the model sampled: under a grammar a model may spell ``{"name": "`` as
``{``, ``"``, ``name``, ... where the tokenizer writes ``{"``, ``name``, ``":``. The prompt
would leave the cached path at the first such token, and the turn and everything after it
would be prefilled again. So each finished chat choice that made tool calls is remembered
under its call ids (least recently used first out); when a later prompt holds an assistant
message with one of those ids and the rendered prompt contains that turn's text verbatim (as
``decode`` writes the ids), that span of the prompt takes the generated ids. The prompt's text
is the same either way; only how it is split into tokens changes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.tokenizer_manager import RequestOutput

DEFAULT_CAPACITY = 4096


class GeneratedTurns:
    """Generated ids of recent tool-calling turns by call id; safe to use from the tokenizer
    threads and the event loop."""

    def __init__(self, tokenizer: Any, capacity: int = DEFAULT_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._turns: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._arguments: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(
        self,
        call_ids: Sequence[str],
        final: RequestOutput,
        arguments: Sequence[str] | None = None,
    ) -> None:
        """Record a finished choice's output ids under its calls' ids. The token that stopped
        it (its finish reason's ``matched``, e.g. the turn's end) is left out: the template
        writes its own turn end. ``arguments``: each call's arguments as the model wrote them,
        for APIs whose clients send a call's arguments back as an object (``arguments_text``)."""
        if not call_ids or not final.output_ids:
            return
        ids = tuple(final.output_ids[:-1] if final.ends_with_stop_token else final.output_ids)
        with self._lock:
            for call_id in call_ids:
                self._turns[call_id] = ids
                self._turns.move_to_end(call_id)
            for call_id, text in zip(call_ids, arguments or (), strict=False):
                self._arguments[call_id] = text
                self._arguments.move_to_end(call_id)
            for table in (self._turns, self._arguments):
                while len(table) > self.capacity:
                    table.popitem(last=False)

    def arguments_text(self, call_id: str, arguments: Any) -> str:
        """Call ``call_id``'s arguments as the model wrote them when they are ``arguments``
        (an object sent back), else ``arguments`` as compact-spaced JSON."""
        with self._lock:
            written = self._arguments.get(call_id)
        if written is not None and json.loads(written) == arguments:
            return written
        return json.dumps(arguments, ensure_ascii=False)

    def prompt_ids(self, rendered: str, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered chat prompt, generated ids spliced in where ``messages``
        re-send a remembered turn. Runs the tokenizer: call it on a tokenizer thread."""
        ids: list[int] = []
        pos = 0
        for turn in self._resent_turns(messages):
            text = self.tokenizer.decode(list(turn), skip_special_tokens=False)
            at = rendered.find(text, pos) if text else -1
            if at < 0:
                continue
            ids += self._encode(rendered[pos:at]) + list(turn)
            pos = at + len(text)
        return ids + self._encode(rendered[pos:])

    def _resent_turns(self, messages: Sequence[dict[str, Any]]) -> list[tuple[int, ...]]:
        turns = []
        with self._lock:
            for message in messages:
                if message.get("role") != "assistant":
                    continue
                for call in message.get("tool_calls") or []:
                    call_id = call.get("id") if isinstance(call, dict) else None
                    if isinstance(call_id, str) and call_id in self._turns:
                        self._turns.move_to_end(call_id)
                        turns.append(self._turns[call_id])
                        break
        return turns

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []
