"""Vector stores made and filled: what the Vector Stores API does when asked, and what an
Assistants thread does when its messages bring files (OpenAI makes the thread a store of
its own). One unit of work each, on a session the caller holds."""

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.protocol.errors import ConflictError, InvalidRequestError
from deployments.http.caller import Caller
from deployments.state.base import new_id, now
from deployments.state.database import find, take_turns
from deployments.state.files import StoredFile, VectorStore, VectorStoreFile

DAY_S = 86_400
TOUCH_EVERY_S = 60
DEFAULT_CHUNKING = {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}  # OpenAI's


def expiry(store: VectorStore) -> None:
    after = store.expires_after
    store.expires_at = None if not after else store.last_active_at + after["days"] * DAY_S


def live(store: VectorStore) -> None:
    """400 for a store past its expiry, as OpenAI's: searching it (a run on a thread
    whose store expired fails until a new store is attached) or adding files to it."""
    if store.expires_at is not None and store.expires_at <= now():
        raise InvalidRequestError(f"vector store {store.id} has expired", "vector_store_id")


def in_use(s: Session, store_ids: list[str]) -> list[VectorStore]:
    """Stores a search is about to read: 400 for an expired one. Returns those whose
    last use should move to now (`touch`, after the search's reads: on SQLite a write
    holds the database's one write lock until the commit); at most once a minute a
    store, so that a search is seldom a write."""
    stores = list(s.scalars(select(VectorStore).where(VectorStore.id.in_(store_ids))))
    for store in stores:
        live(store)
    return [store for store in stores if now() - store.last_active_at >= TOUCH_EVERY_S]


def touch(stores: list[VectorStore]) -> None:
    """Their last use is now, which pushes their expiry on."""
    for store in stores:
        store.last_active_at = now()
        expiry(store)


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
    not see, 409 past `max_files` in the store, 400 when it has expired. Batches racing
    into one store take turns: the store's own row is written first, always (on SQLite
    that takes the write lock), so each reads what the others queued, and none passes
    the limit with another or adds a file another is adding."""
    live(store)
    ids = [e["file_id"] for e in entries]
    for file_id in ids:
        find(s, StoredFile, file_id, who)
    take_turns(s, f"vector_store:{store.id}")
    stamp = now()  # an UPDATE statement writes even when the value is the same
    s.execute(update(VectorStore).where(VectorStore.id == store.id).values(last_active_at=stamp))
    store.last_active_at = stamp
    expiry(store)
    there = {
        r.file_id: r
        for r in s.scalars(
            select(VectorStoreFile).where(
                VectorStoreFile.store_id == store.id, VectorStoreFile.file_id.in_(ids)
            )
        )
    }
    rows, added = [], 0
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
            added += 1
        rows.append(row)
    s.flush()
    held = s.scalar(select(func.count()).where(VectorStoreFile.store_id == store.id)) or 0
    if held > max_files:  # the transaction is undone: none of these files is queued
        raise ConflictError(
            f"a vector store holds at most {max_files:,} files; {store.id} holds {held - added:,}"
        )
    store.last_active_at = now()
    expiry(store)
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
