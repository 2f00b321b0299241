"""Stored Responses (OpenAI's Responses API, `store: true`): what GET returns and what a
`previous_response_id` continues from.

Each entry keeps only its own turn (its input and output as chat-template messages) and
the id it continued; a conversation is read by walking back along the chain. The store
is in memory, per ingress replica, and bounded in count and in bytes (least recently
used first out; a request may be megabytes, so a count alone bounds nothing): a chain
whose older turn has been dropped can no longer be continued (404, which says so). The
KV of a chain lives in a persistent context on a model replica (warm_context.py), named
after the chain's first response.
"""

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from app.protocol.errors import InvalidRequestError, NotFoundError

MAX_RESPONSES = 10_000
MAX_BYTES = 1 << 30  # of stored JSON, per ingress replica
MAX_CHAIN = 1_000  # turns walked back: deeper chains are refused, not walked for ever
# A conversation to continue: far more text than any context window holds, so a longer
# one is refused before it is sent to be rendered, not after.
MAX_CONVERSATION_BYTES = 16 << 20


@dataclass
class StoredResponse:
    id: str
    model: str
    chain: str  # the first response's id: names the chain's context
    previous_id: str | None
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # this turn's input and output, as the template takes them
    body: dict[str, Any] = field(default_factory=dict)  # the Response object
    size: int = 0  # bytes of its JSON, counted when stored


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise NotFoundError(f"Response with id '{response_id}' not found.", param)
        self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        if entry.id in self._entries:
            self._drop(entry.id)
        parts = [entry.input_items, entry.messages, entry.body]
        entry.size = len(json.dumps(parts, default=str))
        self._entries[entry.id] = entry
        self._bytes += entry.size
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_responses or self._bytes > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size

    def conversation(self, response_id: str) -> tuple[StoredResponse, list[dict[str, Any]]]:
        """The response `response_id` continues from, and the whole conversation up to and
        including it."""
        last = self.get(response_id, "previous_response_id")
        turns, entry, size = [last], last, last.size
        while entry.previous_id is not None and size <= MAX_CONVERSATION_BYTES:
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
            entry, size = older, size + older.size
        if size > MAX_CONVERSATION_BYTES:
            raise InvalidRequestError(
                f"the conversation up to {response_id} is over {MAX_CONVERSATION_BYTES} bytes: "
                "too long to continue",
                "previous_response_id",
            )
        return last, [m for turn in reversed(turns) for m in turn.messages]
