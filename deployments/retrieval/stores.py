"""Vector stores made and filled: what the Vector Stores API does when asked, and what an
Assistants thread does when its messages bring files (OpenAI makes the thread a store of
its own). One unit of work each, on a session the caller holds."""

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.protocol.errors import ConflictError
from deployments.http.caller import Caller
from deployments.state.base import new_id, now
from deployments.state.database import find
from deployments.state.files import StoredFile, VectorStore, VectorStoreFile

DAY_S = 86_400
DEFAULT_CHUNKING = {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}  # OpenAI's


def expiry(store: VectorStore) -> None:
    after = store.expires_after
    store.expires_at = None if not after else store.last_active_at + after["days"] * DAY_S


def new_store(s: Session, who: Caller | None, **fields: object) -> VectorStore:
    """A new, empty store owned by `who`'s key."""
    owner = None if who is None else who.key_id
    fields.setdefault("meta", {})
    store = VectorStore(id=new_id("vs"), owner=owner, version=0, **fields)
    store.last_active_at = now()
    expiry(store)
    s.add(store)
    return store


def queue_files(
    s: Session,
    store: VectorStore,
    entries: list[dict],
    batch: str | None,
    who: Caller | None,
    max_files: int,
) -> list[VectorStoreFile]:
    """Queue these files (each `{"file_id", "chunking", "attributes"?}`) in the store,
    for the ingestor; a file already there is left as it is. 404 for a file `who` may
    not see, 409 past `max_files` in the store."""
    ids = [e["file_id"] for e in entries]
    for file_id in ids:
        find(s, StoredFile, file_id, who)
    held = s.scalar(select(func.count()).where(VectorStoreFile.store_id == store.id)) or 0
    there = {
        r.file_id: r
        for r in s.scalars(
            select(VectorStoreFile).where(
                VectorStoreFile.store_id == store.id, VectorStoreFile.file_id.in_(ids)
            )
        )
    }
    new = {e["file_id"] for e in entries} - set(there)
    if held + len(new) > max_files:
        raise ConflictError(
            f"a vector store holds at most {max_files:,} files; {store.id} holds {held:,}"
        )
    rows = []
    for e in entries:
        row = there.get(e["file_id"])
        if row is None:
            row = VectorStoreFile(
                store_id=store.id,
                file_id=e["file_id"],
                batch_id=batch,
                status="in_progress",
                chunking=e.get("chunking") or dict(DEFAULT_CHUNKING),
                attributes=e.get("attributes"),
                usage_bytes=0,
                leased_at=0.0,
            )
            s.add(row)
            there[e["file_id"]] = row
        rows.append(row)
    store.last_active_at = now()
    expiry(store)
    s.flush()
    return rows


def pending(s: Session, store_ids: list[str]) -> int:
    """Files of these stores still being indexed."""
    return (
        s.scalar(
            select(func.count()).where(
                VectorStoreFile.store_id.in_(store_ids), VectorStoreFile.status == "in_progress"
            )
        )
        or 0
    )
