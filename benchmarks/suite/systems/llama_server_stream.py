"""The wire format of llama-server's ``POST /completion``: the request a replayed call sends,
and what its stream of server-sent events delivers."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.suite.systems.llama_server_process import ServerError


def completion_body(prompt: tuple[int, ...] | list[int], new_tokens: int) -> dict[str, Any]:
    """A greedy, streamed ``/completion`` request for exactly ``new_tokens`` tokens."""
    return {
        "prompt": list(prompt),
        "n_predict": new_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": True,
        "return_tokens": True,
        "stream": True,
    }


def parse_event(line: str) -> dict[str, Any] | None:
    """The JSON of one server-sent-event line (``data: {...}``); None for other lines."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if not payload or payload == "[DONE]":
        return None
    event = json.loads(payload)
    if "error" in event:
        raise ServerError(f"llama-server error: {event['error']}")
    return event


class StreamedCompletion:
    """What one ``/completion`` stream delivered, event by event.

    A streamed event carries one token id, and ``tokens_predicted``, how many tokens the slot
    has generated so far. A token that ends inside a UTF-8 character is held back: its text
    goes out with the next token's event, its id never does. Such a token reaches the client
    with the next event (its time is that event's), and ``output_ids`` is None because an id
    is missing. ``cache_n``: prompt tokens taken from the slot's cache (the final event's)."""

    def __init__(self, new_tokens: int) -> None:
        self.new_tokens = new_tokens
        self.ids: list[int | None] = []
        self.cache_n = 0
        self.stopped = False

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def output_ids(self) -> tuple[int, ...] | None:
        if any(token is None for token in self.ids):
            return None
        return tuple(token for token in self.ids if token is not None)

    def add(self, event: dict[str, Any]) -> int:
        """Take one event; returns how many more tokens reached the client with it."""
        tokens = [int(t) for t in event.get("tokens") or []]
        generated = int(event.get("tokens_predicted", self.count + len(tokens)))
        generated = min(generated, self.new_tokens)
        before = self.count
        held = generated - before - len(tokens)
        self.ids += [None] * max(held, 0)
        self.ids += tokens
        del self.ids[self.new_tokens :]  # n_predict may overshoot by a token
        if event.get("stop"):
            self.stopped = True
            self.cache_n = int((event.get("timings") or {}).get("cache_n", 0))
        return self.count - before
