"""OpenAI's Conversations, in the app's database (deployments/state/conversations.py), so
that every ingress replica lists, changes and continues every conversation.

A conversation belongs to the key that made it: another key reads, lists, changes,
deletes or continues it as one that does not exist (404). The KV of a conversation lives
in a persistent context on a model replica (warm_context.py), named by `context_id`.
"""

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError, NotFoundError
from deployments.api.responses.item_messages import NewItem, fold
from deployments.api.responses.store import MAX_CONVERSATION_BYTES
from deployments.http.caller import Caller
from deployments.state.base import new_id, now
from deployments.state.conversations import Conversation, ConversationItem
from deployments.state.database import Database, page, visible

logger = logging.getLogger("ray.serve")


def context_id(conversation_id: str) -> str:
    return f"conversations/{conversation_id}"


@dataclass
class Joined:
    """A response's conversation, and the turn's own input items, added after it."""

    id: str
    items: list[NewItem]


def _find(s: Session, conversation_id: str, who: Caller | None, param: str | None) -> Conversation:
    """The conversation `who` may see (None: the server itself); another key's is a 404,
    as one that does not exist."""
    stmt = select(Conversation).filter_by(id=conversation_id)
    row = s.scalar(stmt.where(*visible(Conversation, who)))
    if row is None:
        raise NotFoundError(f"Conversation with id '{conversation_id}' not found.", param)
    return row


def _item(s: Session, conversation_id: str, item_id: str) -> ConversationItem:
    row = s.scalar(select(ConversationItem).filter_by(id=item_id, conversation_id=conversation_id))
    if row is None:
        raise NotFoundError(f"Item with id '{item_id}' not found.", None)
    return row


def _add(s: Session, conversation_id: str, items: list[NewItem]) -> list[dict[str, Any]]:
    at = now()
    for new in items:
        size = len(json.dumps(new.message))
        s.add(
            ConversationItem(
                id=new.item["id"],
                conversation_id=conversation_id,
                created_at=at,
                item=new.item,
                message=new.message,
                size=size,
            )
        )
    return [new.item for new in items]


def append_turn(conversation_id: str, items: list[NewItem], s: Session) -> None:
    """A finished response's input and output items, in the transaction that stores the
    response. A conversation deleted while the response was made gets nothing (the
    response was checked against it when it began)."""
    if s.scalar(select(Conversation.id).filter_by(id=conversation_id)) is None:
        logger.info("conversation %s was deleted during a response: nothing added", conversation_id)
        return
    _add(s, conversation_id, items)


def _listed(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


class ConversationStore:
    def __init__(self, db: Database) -> None:
        self.db = db  # the Responses' own: a turn and its items commit together

    async def create(
        self, metadata: dict[str, str] | None, items: list[NewItem], who: Caller
    ) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            row = Conversation(
                id=new_id("conv"), owner=who.key_id, created_at=now(), meta=metadata or {}
            )
            s.add(row)
            _add(s, row.id, items)
            return row.as_api()

        return await self.db.work(work)

    async def get(self, conversation_id: str, who: Caller) -> dict[str, Any]:
        return await self.db.work(lambda s: _find(s, conversation_id, who, None).as_api())

    async def update(
        self, conversation_id: str, metadata: dict[str, str] | None, who: Caller
    ) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            row = _find(s, conversation_id, who, None)
            row.meta = metadata or {}
            return row.as_api()

        return await self.db.work(work)

    async def delete(self, conversation_id: str, who: Caller) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            _find(s, conversation_id, who, None)
            s.execute(delete(ConversationItem).filter_by(conversation_id=conversation_id))
            gone = s.execute(delete(Conversation).filter_by(id=conversation_id))
            if gone.rowcount == 0:  # a concurrent delete (another replica) took it first
                raise NotFoundError(f"Conversation with id '{conversation_id}' not found.")
            return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

        return await self.db.work(work)

    async def items(
        self, conversation_id: str, who: Caller, limit: int, order: str, after: str | None
    ) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            _find(s, conversation_id, who, None)
            where = {"conversation_id": conversation_id}
            return page(s, ConversationItem, limit, order, after, **where)

        return await self.db.work(work)

    async def append(
        self, conversation_id: str, items: list[NewItem], who: Caller
    ) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            _find(s, conversation_id, who, None)
            return _listed(_add(s, conversation_id, items))

        return await self.db.work(work)

    async def item(self, conversation_id: str, item_id: str, who: Caller) -> dict[str, Any]:
        def work(s: Session) -> dict[str, Any]:
            _find(s, conversation_id, who, None)
            return _item(s, conversation_id, item_id).as_api()

        return await self.db.work(work)

    async def delete_item(self, conversation_id: str, item_id: str, who: Caller) -> dict[str, Any]:
        """Forget one item (the next turn's prompt goes without it); returns the
        conversation, as OpenAI does."""

        def work(s: Session) -> dict[str, Any]:
            row = _find(s, conversation_id, who, None)
            s.delete(_item(s, conversation_id, item_id))
            return row.as_api()

        return await self.db.work(work)

    async def messages(self, joined: Joined, who: Caller) -> list[dict[str, Any]]:
        """The prompt's messages for a turn of `joined`: its conversation's items so far,
        then the turn's own, folded. A conversation too long to continue is refused
        before its items are read."""

        def work(s: Session) -> list[dict[str, Any]]:
            _find(s, joined.id, who, "conversation")
            where = ConversationItem.conversation_id == joined.id
            size = s.scalar(select(func.coalesce(func.sum(ConversationItem.size), 0)).where(where))
            if size > MAX_CONVERSATION_BYTES:
                raise InvalidRequestError(
                    f"conversation {joined.id} is over {MAX_CONVERSATION_BYTES} bytes: too "
                    "long to continue",
                    "conversation",
                )
            stmt = select(ConversationItem.message).where(where).order_by(ConversationItem.seq)
            return list(s.scalars(stmt))

        history = await self.db.work(work)
        return fold([*history, *(new.message for new in joined.items)])
