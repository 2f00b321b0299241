"""The Assistants API's tables (SQLAlchemy 2 declarative models), each row able to say
itself as the API's object (`as_api`).

Rows are found by their public id (`asst_...`, `thread_...`); `seq`, an increasing
integer, orders them for the cursor pagination (`after`, `before`), since `created_at`
has a resolution of one second. Children name their thread by its public id and are
deleted with it by the store (no foreign keys: SQLite ignores them by default, and the
store deletes in one transaction anyway). The migrations in `migrations/` create exactly
these tables; a change here is a new migration there.

OWNERS: an assistant and a thread belong to the key that made them (`owner`, the key's
id, never the key); a thread's messages, runs and steps are its thread's. A key sees only
its own (another's id is a 404, as OpenAI answers), an admin key and a server without
keys see all (deployments/http/caller.py). A row made before owners were kept has none:
only an admin or a server without keys sees it, since whose it was is not known.

Tools (0008): the columns added then are nullable, since rows made before have none; a
row made since always has them. A message's `excerpts` and `prelude`, and a run's
`tool_turns` and `vector_store_ids`, are never shown: they are what a run rendered
(the file_search excerpts put in a user message, the calls and tool outputs before a
reply), kept so that every later run renders the thread exactly as the first did and
the thread's warm context is reused.
"""

import time
from typing import Any

from sqlalchemy import JSON, Boolean, Float, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from deployments.state.base import Base, now

# A run waiting for its tool outputs (requires_action) holds its thread as one working.
RUN_ACTIVE = ("queued", "in_progress", "requires_action", "cancelling")
# One active run per thread, kept by the database itself (two ingresses may race to start
# one): a partial unique index, which SQLite and PostgreSQL both have.
ACTIVE_WHERE = text("status IN ('queued', 'in_progress', 'requires_action', 'cancelling')")


class Assistant(Base):
    __tablename__ = "assistants"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)  # see OWNERS
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    name: Mapped[str | None] = mapped_column(String(256))
    description: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(256))
    instructions: Mapped[str | None] = mapped_column(Text)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    temperature: Mapped[float | None] = mapped_column(Float)
    top_p: Mapped[float | None] = mapped_column(Float)
    response_format: Mapped[Any] = mapped_column(JSON, default="auto")
    tools: Mapped[list | None] = mapped_column(JSON, default=list)
    tool_resources: Mapped[dict | None] = mapped_column(JSON, default=dict)

    def as_api(self) -> dict:
        return {
            "id": self.id,
            "object": "assistant",
            "created_at": self.created_at,
            "name": self.name,
            "description": self.description,
            "model": self.model,
            "instructions": self.instructions,
            "tools": self.tools or [],
            "tool_resources": self.tool_resources or {},
            "metadata": self.meta or {},
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": self.response_format,
        }


class Thread(Base):
    __tablename__ = "threads"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)  # see OWNERS
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    tool_resources: Mapped[dict | None] = mapped_column(JSON, default=dict)

    def as_api(self) -> dict:
        return {
            "id": self.id,
            "object": "thread",
            "created_at": self.created_at,
            "metadata": self.meta or {},
            "tool_resources": self.tool_resources or {},
        }


class Message(Base):
    __tablename__ = "messages"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str] = mapped_column(Text, default="")
    status: Mapped[str] = mapped_column(String(16), default="completed")
    assistant_id: Mapped[str | None] = mapped_column(String(64))
    run_id: Mapped[str | None] = mapped_column(String(64))
    completed_at: Mapped[int | None] = mapped_column(Integer)
    incomplete_at: Mapped[int | None] = mapped_column(Integer)
    incomplete_details: Mapped[dict | None] = mapped_column(JSON)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    attachments: Mapped[list | None] = mapped_column(JSON, default=list)
    annotations: Mapped[list | None] = mapped_column(JSON, default=list)  # of its text part
    # Hidden (see the module's docstring): the chunks a file_search put before this (user)
    # message's text, as deployments/retrieval's Found fields; None: never searched for.
    excerpts: Mapped[list | None] = mapped_column(JSON)
    # Hidden: the run's calls and tool outputs before this (assistant) reply, as chat
    # template messages.
    prelude: Mapped[list | None] = mapped_column(JSON)

    def as_api(self) -> dict:
        text_part = {"value": self.text, "annotations": self.annotations or []}
        return {
            "id": self.id,
            "object": "thread.message",
            "created_at": self.created_at,
            "thread_id": self.thread_id,
            "status": self.status,
            "incomplete_details": self.incomplete_details,
            "completed_at": self.completed_at,
            "incomplete_at": self.incomplete_at,
            "role": self.role,
            # Empty until the first piece: the SDK's accumulator then starts a text part
            # (on_text_created), as OpenAI's own streams have it.
            "content": [{"type": "text", "text": text_part}] if self.text else [],
            "assistant_id": self.assistant_id,
            "run_id": self.run_id,
            "attachments": self.attachments or [],
            "metadata": self.meta or {},
        }


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        Index(
            "one_active_run_per_thread",
            "thread_id",
            unique=True,
            sqlite_where=ACTIVE_WHERE,
            postgresql_where=ACTIVE_WHERE,
        ),
    )

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    assistant_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    model: Mapped[str] = mapped_column(String(256))
    instructions: Mapped[str | None] = mapped_column(Text)
    temperature: Mapped[float | None] = mapped_column(Float)
    top_p: Mapped[float | None] = mapped_column(Float)
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    max_completion_tokens: Mapped[int | None] = mapped_column(Integer)
    response_format: Mapped[Any] = mapped_column(JSON, default="auto")
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    started_at: Mapped[int | None] = mapped_column(Integer)
    completed_at: Mapped[int | None] = mapped_column(Integer)
    cancelled_at: Mapped[int | None] = mapped_column(Integer)
    failed_at: Mapped[int | None] = mapped_column(Integer)
    expires_at: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[dict | None] = mapped_column(JSON)
    incomplete_details: Mapped[dict | None] = mapped_column(JSON)
    usage: Mapped[dict | None] = mapped_column(JSON)
    # When an ingress last showed it was working on this run (its lease); see the store.
    leased_at: Mapped[float] = mapped_column(Float, default=time.time)
    tools: Mapped[list | None] = mapped_column(JSON, default=list)  # its own or its assistant's
    tool_choice: Mapped[Any] = mapped_column(JSON, default="auto", nullable=True)
    parallel_tool_calls: Mapped[bool | None] = mapped_column(Boolean, default=True)
    # {"type": "submit_tool_outputs", ...} while it waits for them (requires_action).
    required_action: Mapped[dict | None] = mapped_column(JSON)
    # Hidden: the calls and outputs so far, which its next generation continues from.
    tool_turns: Mapped[list | None] = mapped_column(JSON, default=list)
    # Hidden: the stores its file_search searches (its assistant's and its thread's).
    vector_store_ids: Mapped[list | None] = mapped_column(JSON, default=list)

    def as_api(self) -> dict:
        return {
            "id": self.id,
            "object": "thread.run",
            "created_at": self.created_at,
            "thread_id": self.thread_id,
            "assistant_id": self.assistant_id,
            "status": self.status,
            "required_action": self.required_action if self.status == "requires_action" else None,
            "last_error": self.last_error,
            "expires_at": self.expires_at if self.status in RUN_ACTIVE else None,
            "started_at": self.started_at,
            "cancelled_at": self.cancelled_at,
            "failed_at": self.failed_at,
            "completed_at": self.completed_at,
            "incomplete_details": self.incomplete_details,
            "model": self.model,
            "instructions": self.instructions or "",
            "tools": self.tools or [],
            "metadata": self.meta or {},
            "usage": self.usage,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_completion_tokens": self.max_completion_tokens,
            "truncation_strategy": {"type": "auto", "last_messages": None},
            "response_format": self.response_format,
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
        }

    def as_work(self) -> dict:
        """What its executor needs beyond `as_api`: the hidden columns."""
        hidden = {
            "tool_turns": self.tool_turns or [],
            "vector_store_ids": self.vector_store_ids or [],
        }
        return self.as_api() | hidden


class RunStep(Base):
    __tablename__ = "run_steps"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    assistant_id: Mapped[str] = mapped_column(String(64))
    message_id: Mapped[str | None] = mapped_column(String(64))  # a message_creation's
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    status: Mapped[str] = mapped_column(String(16), default="in_progress")
    completed_at: Mapped[int | None] = mapped_column(Integer)
    cancelled_at: Mapped[int | None] = mapped_column(Integer)
    failed_at: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[dict | None] = mapped_column(JSON)
    usage: Mapped[dict | None] = mapped_column(JSON)
    type: Mapped[str | None] = mapped_column(String(16), default="message_creation")
    tool_calls: Mapped[list | None] = mapped_column(JSON)  # a tool_calls step's, as shown
    expired_at: Mapped[int | None] = mapped_column(Integer)

    def as_api(self) -> dict:
        kind = self.type or "message_creation"
        if kind == "tool_calls":
            details = {"type": kind, "tool_calls": self.tool_calls or []}
        else:
            details = {"type": kind, "message_creation": {"message_id": self.message_id}}
        return {
            "id": self.id,
            "object": "thread.run.step",
            "created_at": self.created_at,
            "run_id": self.run_id,
            "assistant_id": self.assistant_id,
            "thread_id": self.thread_id,
            "type": kind,
            "status": self.status,
            "cancelled_at": self.cancelled_at,
            "completed_at": self.completed_at,
            "expired_at": self.expired_at,
            "failed_at": self.failed_at,
            "last_error": self.last_error,
            "step_details": details,
            "usage": self.usage,
            "metadata": None,
        }
