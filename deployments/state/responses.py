"""Stored Responses (OpenAI's Responses API, `store: true`): one row a turn, in the app's
database, so that any ingress replica answers a GET or continues a chain.

A row keeps only its own turn (its input items, its input and output as chat-template
messages, and the Response object) and the id it continued; a conversation is read by
walking back along `previous_id`. `chain` is the first response's id: it names the
chain's warm context on a model replica (deployments/api/warm_context.py). Rows older
than 30 days are deleted as new ones are stored, as OpenAI keeps stored responses.
A response belongs to the key that made it (`owner`, as state/assistants.py says).
"""

from typing import Any

from sqlalchemy import JSON, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from deployments.state.base import Base, now


class StoredResponse(Base):
    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(64))  # as the Assistants' OWNERS
    model: Mapped[str] = mapped_column(String(200))
    chain: Mapped[str] = mapped_column(String(64), index=True)
    previous_id: Mapped[str | None] = mapped_column(String(64))
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    messages: Mapped[list[Any]] = mapped_column(JSON)  # the turn's, as templates take them
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object
    size: Mapped[int] = mapped_column(Integer)  # bytes of the three above, as JSON
    created_at: Mapped[int] = mapped_column(Integer, default=now, index=True)
