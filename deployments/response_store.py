"""Stored Responses (OpenAI's Responses API, `store: true`): what GET returns and what a
`previous_response_id` continues from.

Each entry keeps only its own turn (its input and output as chat-template messages) and
the id it continued; a conversation is read by walking back along the chain. The store
is in memory, per ingress replica, and bounded (least recently used first out): a chain
whose older turn has been dropped can no longer be continued (404, which says so). The
KV of a chain lives in a persistent context on a model replica (warm_context.py), named
after the chain's first response.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from app.protocol.errors import NotFoundError

MAX_RESPONSES = 10_000
MAX_CHAIN = 1_000  # turns walked back: deeper chains are refused, not walked for ever


@dataclass
class StoredResponse:
    id: str
    model: str
    chain: str  # the first response's id: names the chain's context
    previous_id: str | None
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # this turn's input and output, as the template takes them
    body: dict[str, Any] = field(default_factory=dict)  # the Response object


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.", param)
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def conversation(self, response_id: str) -> tuple[StoredResponse, list[dict[str, Any]]]:
        """The response `response_id` continues from, and the whole conversation up to and
        including it."""
        last = self.get(response_id, "previous_response_id")
        turns, entry = [last], last
        while entry.previous_id is not None:
            if len(turns) >= MAX_CHAIN:
                raise NotFoundError(
                    f"the chain of {response_id} is over {MAX_CHAIN} turns", "previous_response_id"
                )
            older = self._entries.get(entry.previous_id)
            if older is None:
                raise NotFoundError(
                    f"response {entry.previous_id}, earlier in the chain of {response_id}, is no "
                    "longer stored (deleted, or dropped for the store's limit)",
                    "previous_response_id",
                )
            self._entries.move_to_end(older.id)
            turns.append(older)
            entry = older
        return last, [m for turn in reversed(turns) for m in turn.messages]
