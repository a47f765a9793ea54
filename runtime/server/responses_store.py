"""The bounded in-memory store of responses created with ``store: true``.

Each stored response keeps what ``GET /v1/responses/{id}`` returns, its input items, and what
a later turn needs to continue it with ``previous_response_id``: the conversation as chat
messages (without the instructions, which a turn does not inherit) and the exact tokens the
model saw and produced, so the next prompt can start with those very tokens and continue from
their KV in the radix cache. Oldest entries go first once ``capacity``
responses are held.

A response, and the items in it, belong to the caller's key and cache salt that made it
(``Owner``): for any other owner the store holds nothing under that id, exactly as for an id it
never held.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# (the caller's key, runtime.server.state.caller_of; the request's cache salt)
Owner = tuple[str, str | None]
NO_OWNER: Owner = ("", None)


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as returned to the client
    input_items: list[dict[str, Any]]  # this turn's input items, ids added
    messages: list[dict[str, Any]]  # the whole conversation so far, this turn's output included
    prompt_text: str  # the prompt as the chat template rendered it
    # Token ids as 4-byte arrays: a long conversation's turns each keep their whole prompt.
    prompt_ids: array[int]  # the tokens the model was given (see responses_api._prompt)
    output_ids: array[int]  # the tokens it produced, the stop token included
    ends_with_stop_token: bool  # output_ids[-1] is the stop token that ended the output
    answer_index: int | None  # index in messages of this turn's one assistant message
    owner: Owner = NO_OWNER


class ResponseStore:
    """Responses by id, least recently stored dropped first beyond ``capacity``; each read
    only by its owner."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # (owner, item id) -> (response id, item): a client may give its input items any id.
        self._items: dict[tuple[Owner, str], tuple[str, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str, owner: Owner = NO_OWNER) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def put(self, stored: StoredResponse) -> None:
        response_id = stored.response["id"]
        self.delete(response_id)
        self._responses[response_id] = stored
        for item in (*stored.input_items, *stored.response["output"]):
            if isinstance(item.get("id"), str):
                self._items[stored.owner, item["id"]] = (response_id, item)
        while len(self._responses) > self.capacity:
            self.delete(next(iter(self._responses)))

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        for item in (*stored.input_items, *stored.response["output"]):
            key = (stored.owner, item.get("id", ""))
            found = self._items.get(key)
            if found is not None and found[0] == response_id:
                del self._items[key]
        return True

    def item(self, item_id: str, owner: Owner = NO_OWNER) -> dict[str, Any] | None:
        """A stored input or output item of ``owner``'s by its id."""
        found = self._items.get((owner, item_id))
        return found[1] if found is not None else None
