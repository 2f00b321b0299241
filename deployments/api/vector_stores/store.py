"""VectorStoresStore: every read and write of vector stores, their files and batches,
each one unit of work on the app's database. A store belongs to the key that made it (as
OWNERS in deployments/state/assistants.py); its files and batches are the store's. A
file added to a store must be one the caller may see. Indexing is the ingestor's
(deployments/retrieval/ingest.py): adding a file here only queues it and pokes it."""

from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from deployments.http.caller import Caller
from deployments.retrieval.service import Retrieval
from deployments.retrieval.stores import expiry as _expiry
from deployments.retrieval.stores import new_store, queue_files
from deployments.state.base import new_id
from deployments.state.database import find, page
from deployments.state.files import (
    FILE_STATUSES,
    Chunk,
    FileBatch,
    VectorStore,
    VectorStoreFile,
)

Who = Caller | None


def counts(s: Session, store_id: str, batch_id: str | None = None) -> dict[str, int]:
    where = [VectorStoreFile.store_id == store_id]
    if batch_id is not None:
        where.append(VectorStoreFile.batch_id == batch_id)
    rows = s.execute(
        select(VectorStoreFile.status, func.count()).where(*where).group_by(VectorStoreFile.status)
    ).all()
    out = dict.fromkeys(FILE_STATUSES, 0) | {status: n for status, n in rows}
    return {**out, "total": sum(out.values())}


def store_api(s: Session, store: VectorStore) -> dict:
    used = s.scalar(
        select(func.coalesce(func.sum(VectorStoreFile.usage_bytes), 0)).where(
            VectorStoreFile.store_id == store.id
        )
    )
    return store.as_api(counts(s, store.id), int(used or 0))


class VectorStoresStore:
    def __init__(self, retrieval: Retrieval) -> None:
        self.retrieval = retrieval
        self.db = retrieval.db
        self.max_files = retrieval.config.max_files_per_store

    # ---- stores -----------------------------------------------------------------------
    async def create(self, fields: dict, entries: list[dict], who: Who) -> dict:
        def work(s: Session) -> dict:
            store = new_store(s, who, **fields)
            self._add_files(s, store, entries, None, who)
            s.flush()
            return store_api(s, store)

        made = await self.db.work(work)
        self.retrieval.ingestor.poke()
        return made

    async def get(self, store_id: str, who: Who) -> dict:
        return await self.db.work(lambda s: store_api(s, find(s, VectorStore, store_id, who)))

    async def update(self, store_id: str, fields: dict, who: Who) -> dict:
        def work(s: Session) -> dict:
            store = find(s, VectorStore, store_id, who)
            for name, value in fields.items():
                setattr(store, name, value)
            _expiry(store)
            return store_api(s, store)

        return await self.db.work(work)

    async def list_stores(self, who: Who, **cursor: Any) -> dict:
        def work(s: Session) -> dict:
            listed = page(s, VectorStore, viewer=who, **cursor)
            rows = {
                r.id: r
                for r in s.scalars(
                    select(VectorStore).where(VectorStore.id.in_([d["id"] for d in listed["data"]]))
                )
            }
            listed["data"] = [store_api(s, rows[d["id"]]) for d in listed["data"]]
            return listed

        return await self.db.work(work)

    async def delete(self, store_id: str, who: Who) -> dict:
        def work(s: Session) -> dict:
            store = find(s, VectorStore, store_id, who)
            self._drop_chunks(s, store_id, None)
            s.execute(delete(VectorStoreFile).where(VectorStoreFile.store_id == store_id))
            s.execute(delete(FileBatch).where(FileBatch.store_id == store_id))
            s.delete(store)
            return {"id": store_id, "object": "vector_store.deleted", "deleted": True}

        return await self.db.work(work)

    # ---- files ------------------------------------------------------------------------
    async def add_file(self, store_id: str, entry: dict, who: Who) -> dict:
        def work(s: Session) -> dict:
            store = find(s, VectorStore, store_id, who)
            return self._add_files(s, store, [entry], None, who)[0].as_api()

        made = await self.db.work(work)
        self.retrieval.ingestor.poke()
        return made

    def _add_files(
        self, s: Session, store: VectorStore, entries: list[dict], batch: str | None, who: Who
    ) -> list[VectorStoreFile]:
        return queue_files(s, store, entries, batch, who, self.max_files)

    async def get_file(self, store_id: str, file_id: str, who: Who) -> dict:
        return await self.db.work(lambda s: self._file(s, store_id, file_id, who).as_api())

    def _file(self, s: Session, store_id: str, file_id: str, who: Who) -> VectorStoreFile:
        find(s, VectorStore, store_id, who)
        return find(s, VectorStoreFile, file_id, None, store_id=store_id)

    async def update_file(
        self, store_id: str, file_id: str, attributes: dict | None, who: Who
    ) -> dict:
        def work(s: Session) -> dict:
            row = self._file(s, store_id, file_id, who)
            row.attributes = attributes
            return row.as_api()

        return await self.db.work(work)

    async def file_content(self, store_id: str, file_id: str, who: Who) -> dict:
        def work(s: Session) -> dict:
            self._file(s, store_id, file_id, who)
            texts = s.scalars(
                select(Chunk.text)
                .filter_by(store_id=store_id, file_id=file_id)
                .order_by(Chunk.position)
            )
            data = [{"type": "text", "text": t} for t in texts]
            return {
                "object": "vector_store.file_content.page",
                "data": data,
                "has_more": False,
                "next_page": None,
            }

        return await self.db.work(work)

    async def list_files(
        self,
        store_id: str,
        who: Who,
        status: str | None,
        batch_id: str | None = None,
        **cursor: Any,
    ) -> dict:
        def work(s: Session) -> dict:
            find(s, VectorStore, store_id, who)
            where: dict[str, Any] = {"store_id": store_id}
            if status is not None:
                where["status"] = status
            if batch_id is not None:
                find(s, FileBatch, batch_id, None, store_id=store_id)
                where["batch_id"] = batch_id
            return page(s, VectorStoreFile, **cursor, **where)

        return await self.db.work(work)

    async def delete_file(self, store_id: str, file_id: str, who: Who) -> dict:
        def work(s: Session) -> dict:
            row = self._file(s, store_id, file_id, who)
            self._drop_chunks(s, store_id, file_id)
            s.delete(row)
            return {"id": file_id, "object": "vector_store.file.deleted", "deleted": True}

        return await self.db.work(work)

    def _drop_chunks(self, s: Session, store_id: str, file_id: str | None) -> None:
        self.retrieval.drop_chunks(s, store_id, file_id)

    # ---- batches ----------------------------------------------------------------------
    async def create_batch(self, store_id: str, entries: list[dict], who: Who) -> dict:
        def work(s: Session) -> dict:
            store = find(s, VectorStore, store_id, who)
            batch = FileBatch(id=new_id("vsfb"), store_id=store_id, cancelled=0)
            s.add(batch)
            rows = self._add_files(s, store, entries, batch.id, who)
            for row in rows:  # a file already in the store joins the batch as it is
                row.batch_id = batch.id
            s.flush()
            return batch.as_api(counts(s, store_id, batch.id))

        made = await self.db.work(work)
        self.retrieval.ingestor.poke()
        return made

    async def get_batch(self, store_id: str, batch_id: str, who: Who) -> dict:
        def work(s: Session) -> dict:
            find(s, VectorStore, store_id, who)
            batch = find(s, FileBatch, batch_id, None, store_id=store_id)
            return batch.as_api(counts(s, store_id, batch_id))

        return await self.db.work(work)

    async def cancel_batch(self, store_id: str, batch_id: str, who: Who) -> dict:
        """Files of the batch not yet indexed end `cancelled` (the ingestor drops what it
        was doing with one at its commit)."""

        def work(s: Session) -> dict:
            find(s, VectorStore, store_id, who)
            batch = find(s, FileBatch, batch_id, None, store_id=store_id)
            batch.cancelled = 1
            s.execute(
                update(VectorStoreFile)
                .where(
                    VectorStoreFile.batch_id == batch_id, VectorStoreFile.status == "in_progress"
                )
                .values(status="cancelled")
            )
            return batch.as_api(counts(s, store_id, batch_id))

        return await self.db.work(work)

    async def searchable(self, store_id: str, who: Who) -> None:
        """404 unless the caller may search this store (the search itself refuses an
        expired one and keeps the others active: Retrieval.search)."""
        await self.db.work(find, VectorStore, store_id, who)
