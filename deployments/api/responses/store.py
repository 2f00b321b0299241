"""Stored Responses (`store: true`): what GET returns and what a `previous_response_id`
continues from, in the app's database (deployments/state/responses.py), so every ingress
replica sees every chain. The KV of a chain lives in a persistent context on a model
replica (warm_context.py), named after the chain's first response. A stored response is
its key's: another key reads, lists, deletes or continues it as one never stored (404).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError, NotFoundError, RemoteError
from deployments.http.caller import Caller
from deployments.state.base import now
from deployments.state.database import Database
from deployments.state.responses import StoredResponse

KEPT_S = 30 * 24 * 3600  # as OpenAI keeps stored responses: 30 days, then they go

MAX_CHAIN = 1_000  # turns walked back: deeper chains are refused, not walked for ever
# A conversation to continue: far more text than any context window holds, so a longer
# one is refused before it is sent to be rendered, not after.
MAX_CONVERSATION_BYTES = 16 << 20


@dataclass
class Entry:
    """A stored turn, as the routes read and write it."""

    id: str
    model: str
    chain: str  # the first response's id: names the chain's context
    previous_id: str | None
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # this turn's input and output, as the template takes them
    body: dict[str, Any]  # the Response object
    owner: str | None = None  # the id of the key that made it (Caller.key_id)


def _entry(row: StoredResponse) -> Entry:
    return Entry(
        row.id,
        row.model,
        row.chain,
        row.previous_id,
        row.input_items,
        row.messages,
        row.body,
        row.owner,
    )


def _get(s: Session, response_id: str, param: str, who: Caller | None) -> StoredResponse:
    """The stored response `who` may see (None: the server itself); another key's is
    a 404, as one never stored."""
    row = s.get(StoredResponse, response_id)
    if row is None or (who is not None and not who.owns(row.owner)):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param)
    return row


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def get(
        self, response_id: str, who: Caller | None = None, param: str = "response_id"
    ) -> Entry:
        return await self.db.work(lambda s: _entry(_get(s, response_id, param, who)))

    async def put(self, entry: Entry | None, also: Callable[[Session], Any] | None = None) -> None:
        """Store `entry` (None: a response not stored) and do `also` in the same
        transaction (a conversation's new items): both are kept, or neither."""

        def work(s: Session) -> None:
            if entry is not None:
                _put(s, entry)
            if also is not None:
                also(s)

        try:
            await self.db.work(work)
        except SQLAlchemyError as exc:  # the reply was made: say why it cannot be continued
            raise RemoteError(
                503, "service_unavailable", f"the response could not be stored: {exc}", None
            ) from exc

    async def delete(self, response_id: str, who: Caller | None = None) -> Entry:
        """Forget a response (its later turns can no longer be continued); returns it."""

        def work(s: Session) -> Entry:
            entry = _entry(_get(s, response_id, "response_id", who))
            gone = s.execute(delete(StoredResponse).where(StoredResponse.id == response_id))
            if gone.rowcount == 0:  # a concurrent delete (another replica) took it first
                raise NotFoundError(f"Response with id '{response_id}' not found.", "response_id")
            return entry

        return await self.db.work(work)

    async def conversation(
        self, response_id: str, who: Caller | None = None
    ) -> tuple[Entry, list[dict[str, Any]]]:
        """The response `response_id` continues from (one `who` may see), and the whole
        conversation up to and including it."""
        return await self.db.work(_conversation, response_id, who)

    def close(self) -> None:
        self.db.close()


def _put(s: Session, entry: Entry) -> None:
    size = len(json.dumps([entry.input_items, entry.messages, entry.body], default=str))
    s.execute(delete(StoredResponse).where(StoredResponse.created_at < now() - KEPT_S))
    s.merge(
        StoredResponse(
            id=entry.id,
            model=entry.model,
            chain=entry.chain,
            previous_id=entry.previous_id,
            input_items=entry.input_items,
            messages=entry.messages,
            body=entry.body,
            size=size,
            owner=entry.owner,
        )
    )


def _conversation(
    s: Session, response_id: str, who: Caller | None
) -> tuple[Entry, list[dict[str, Any]]]:
    last = _get(s, response_id, "previous_response_id", who)
    turns, row, size = [last], last, last.size
    while row.previous_id is not None and size <= MAX_CONVERSATION_BYTES:
        if len(turns) >= MAX_CHAIN:
            raise NotFoundError(
                f"the chain of {response_id} is over {MAX_CHAIN} turns", "previous_response_id"
            )
        older = s.get(StoredResponse, row.previous_id)
        if older is None:
            raise NotFoundError(
                f"response {row.previous_id}, earlier in the chain of {response_id}, is no "
                "longer stored (it was deleted)",
                "previous_response_id",
            )
        turns.append(older)
        row, size = older, size + older.size
    if size > MAX_CONVERSATION_BYTES:
        raise InvalidRequestError(
            f"the conversation up to {response_id} is over {MAX_CONVERSATION_BYTES} bytes: "
            "too long to continue",
            "previous_response_id",
        )
    return _entry(last), [m for turn in reversed(turns) for m in turn.messages]
