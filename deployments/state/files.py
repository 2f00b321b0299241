"""Files and vector stores (OpenAI's Files and Vector Stores APIs), as rows of the app's
database; each row able to say itself as the API's object (`as_api`).

A file's bytes live under the app's data directory (`files.data_dir`), named by its id;
its row keeps what the API shows and who owns it (`owner`, as state/assistants.py's
OWNERS). A vector store holds files (`VectorStoreFile`, one row per store and file, its
status going in_progress -> completed | failed | cancelled) and their chunks (`Chunk`):
a file's chunks are written in the same transaction that marks it completed, so a store
never holds half a file. `Chunk.seq` is the chunk's rowid in the vector index
(deployments/retrieval/index.py); `Chunk.embedding` its unit vector as float32 bytes,
which the exact index reads. A store's `version` grows with every change to its chunks,
so that what an ingress cached of it (an exact index's matrix) knows when it is stale.
"""

import time
from typing import Any

from sqlalchemy import JSON, Float, Index, Integer, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, synonym

from deployments.state.base import Base, now

FILE_STATUSES = ("in_progress", "completed", "failed", "cancelled")


class StoredFile(Base):
    __tablename__ = "files"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    media_type: Mapped[str] = mapped_column(String(128))  # what extraction reads it as
    expires_at: Mapped[int | None] = mapped_column(Integer)

    def as_api(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class VectorStore(Base):
    __tablename__ = "vector_stores"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    name: Mapped[str | None] = mapped_column(String(256))
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    expires_after: Mapped[dict | None] = mapped_column(JSON)
    expires_at: Mapped[int | None] = mapped_column(Integer)
    last_active_at: Mapped[int] = mapped_column(Integer, default=now)
    version: Mapped[int] = mapped_column(Integer, default=0)

    def as_api(self, counts: dict[str, int] | None = None, usage_bytes: int = 0) -> dict:
        """The API's object; its counts and usage are its files' (the store passes them:
        without, a page's rows say none, and the store fills them in)."""
        counts = counts or dict.fromkeys((*FILE_STATUSES, "total"), 0)
        expired = self.expires_at is not None and self.expires_at <= now()
        return {
            "id": self.id,
            "object": "vector_store",
            "created_at": self.created_at,
            "name": self.name,
            "usage_bytes": usage_bytes,
            "file_counts": counts,
            "status": "expired"
            if expired
            else ("in_progress" if counts["in_progress"] else "completed"),
            "expires_after": self.expires_after,
            "expires_at": self.expires_at,
            "last_active_at": self.last_active_at,
            "metadata": self.meta or {},
        }


class VectorStoreFile(Base):
    __tablename__ = "vector_store_files"
    __table_args__ = (UniqueConstraint("store_id", "file_id"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    store_id: Mapped[str] = mapped_column(String(64), index=True)
    file_id: Mapped[str] = mapped_column(String(64), index=True)
    batch_id: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    status: Mapped[str] = mapped_column(String(16), default="in_progress", index=True)
    last_error: Mapped[dict | None] = mapped_column(JSON)
    # {"max_chunk_size_tokens", "chunk_overlap_tokens"}: how this file is cut
    chunking: Mapped[dict] = mapped_column(JSON)
    attributes: Mapped[dict | None] = mapped_column(JSON)
    usage_bytes: Mapped[int] = mapped_column(Integer, default=0)
    # When an ingress last showed it was indexing this file (its lease): see ingest.py.
    leased_at: Mapped[float] = mapped_column(Float, default=0.0)
    id = synonym("file_id")  # its API id, which lookups and cursors go by

    def as_api(self) -> dict:
        return {
            "id": self.file_id,
            "object": "vector_store.file",
            "usage_bytes": self.usage_bytes,
            "created_at": self.created_at,
            "vector_store_id": self.store_id,
            "status": self.status,
            "last_error": self.last_error,
            "chunking_strategy": {"type": "static", "static": dict(self.chunking)},
            "attributes": self.attributes or {},
        }


class FileBatch(Base):
    __tablename__ = "vector_store_file_batches"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    store_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer, default=now)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)

    def as_api(self, counts: dict[str, int]) -> dict:
        if self.cancelled:
            status = "cancelling" if counts["in_progress"] else "cancelled"
        elif counts["in_progress"]:
            status = "in_progress"
        else:
            status = "failed" if counts["failed"] == counts["total"] > 0 else "completed"
        return {
            "id": self.id,
            "object": "vector_store.files_batch",
            "created_at": self.created_at,
            "vector_store_id": self.store_id,
            "status": status,
            "file_counts": counts,
        }


class Chunk(Base):
    __tablename__ = "chunks"
    __table_args__ = (Index("ix_chunks_store_id_file_id", "store_id", "file_id"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    store_id: Mapped[str] = mapped_column(String(64))
    file_id: Mapped[str] = mapped_column(String(64))
    position: Mapped[int] = mapped_column(Integer)  # the chunk's place in its file
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer)
    embedding: Mapped[bytes] = mapped_column(LargeBinary)

    def as_api(self, filename: str, score: float, attributes: Any) -> dict:
        return {
            "file_id": self.file_id,
            "filename": filename,
            "score": score,
            "attributes": attributes or {},
            "content": [{"type": "text", "text": self.text}],
        }


def lease_expired(leased_at: float, lease_s: float) -> bool:
    return leased_at < time.time() - lease_s
