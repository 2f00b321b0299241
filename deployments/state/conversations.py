"""OpenAI's Conversations (the Responses API's durable lists of items): one row per
conversation and one per item, in the app's database, so that any ingress replica lists
them, adds to them and continues them.

An item keeps the object the API returns (`item`) and what it adds to the chat-template
messages (`message`, a fragment that deployments/api/responses/item_messages.py folds
with its neighbours: a function call joins the assistant turn before it), so a turn
renders the conversation without validating its items again. `size` (the fragment's
bytes as JSON) lets a turn refuse a conversation too long to continue before reading
it. `seq` orders items (the order of the conversation) and pages them. Items name their
conversation by its public id and go with it (no foreign keys, as in assistants.py).
A conversation belongs to the key that made it (`owner`, as OWNERS in assistants.py
says); its items are its conversation's.
"""

from typing import Any

from sqlalchemy import JSON, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from deployments.state.base import Base, now


class Conversation(Base):
    __tablename__ = "conversations"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)  # see OWNERS
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)

    def as_api(self) -> dict:
        return {
            "id": self.id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.meta or {},
        }


class ConversationItem(Base):
    __tablename__ = "conversation_items"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    conversation_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    item: Mapped[dict[str, Any]] = mapped_column(JSON)  # the item, as the API returns it
    message: Mapped[dict[str, Any]] = mapped_column(JSON)  # its chat-template fragment
    size: Mapped[int] = mapped_column(Integer)  # bytes of `message`, as JSON

    def as_api(self) -> dict:
        return self.item
