"""Retrieval: what the vector stores, Assistants' and Responses' `file_search` share, made
once per ingress: the database, the vector index, the Embedder and the ingestor. Its
`search` is the one way any of them finds the chunks nearest a query."""

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError, NotFoundError
from deployments.files_config import FilesConfig
from deployments.http.caller import Caller
from deployments.retrieval.filters import check, matches
from deployments.retrieval.fusion import fuse
from deployments.retrieval.index import Index, open_index
from deployments.retrieval.ingest import Ingestor
from deployments.retrieval.lexical import LexicalIndex
from deployments.retrieval.stores import in_use, new_store, pending, queue_files, touch
from deployments.state.database import Database, find
from deployments.state.files import Chunk, StoredFile, VectorStore, VectorStoreFile

logger = logging.getLogger("ray.serve")
# Each half of a hybrid search brings this many times the results asked for, so that the
# fusion has candidates to agree on.
CANDIDATES = 4
FILTERED_POOL = 500  # candidates a filtered search chooses among


@dataclass
class Found:
    """One chunk a search found, as every caller reports it."""

    seq: int
    file_id: str
    filename: str
    score: float
    attributes: dict
    text: str

    def as_api(self) -> dict:
        return {
            "file_id": self.file_id,
            "filename": self.filename,
            "score": self.score,
            "attributes": self.attributes,
            "content": [{"type": "text", "text": self.text}],
        }


class Retrieval:
    def __init__(self, url: str, config: FilesConfig, embedder: Any) -> None:
        self.config = config
        self.db = Database(url)
        self.index: Index = open_index(self.db.engine)
        self.lexical = LexicalIndex()
        self.embedder = embedder
        self.data_dir = Path(config.data_dir).expanduser()
        self.ingestor = Ingestor(self.db, self.index, self.lexical, embedder, config, self.path_of)

    def path_of(self, file_id: str) -> Path:
        return self.data_dir / file_id

    async def search(
        self,
        store_ids: list[str],
        query: str,
        k: int,
        threshold: float = 0.0,
        hybrid: bool = True,
        filters: dict | None = None,
    ) -> list[Found]:
        """The `k` chunks of these stores nearest `query`: by vector similarity, fused
        with a BM25 ranking of the same stores when `hybrid` (reciprocal rank fusion;
        each result keeps its cosine similarity as its score). Below `threshold`, none.
        With `filters`, only chunks of files whose attributes match, chosen among the
        FILTERED_POOL nearest of each half. An expired store is a 400."""
        if filters is not None:
            check(filters)
        if len(query) > self.config.max_query_chars:
            raise InvalidRequestError(
                f"a query is at most {self.config.max_query_chars} characters", "query"
            )
        if not query.strip() or not store_ids:
            return []
        vectors, _ = await self.embedder.embed.remote([query], True)
        want = k * CANDIDATES if hybrid else k
        if filters is not None:
            want = max(want, FILTERED_POOL)
        return await self.db.work(
            self._search, store_ids, query, vectors[0], k, want, threshold, hybrid, filters
        )

    def _search(
        self,
        s: Session,
        store_ids: list[str],
        query: str,
        vector: list[float],
        k: int,
        want: int,
        threshold: float,
        hybrid: bool,
        filters: dict | None,
    ) -> list[Found]:
        stale = in_use(s, store_ids)
        near = self.index.search(s, store_ids, vector, want)
        scores = dict(near)
        order = [seq for seq, _ in near]
        if hybrid:
            lexical = self.lexical.search(s, store_ids, query, want)
            order = fuse([order, lexical])
            missing = [seq for seq in order if seq not in scores]
            scores.update(self._similarity(s, missing, vector))
        picked = [seq for seq in order if scores.get(seq, 0.0) >= threshold]
        found = self._found(s, picked, scores)
        if filters is not None:
            found = [f for f in found if matches(filters, f.attributes)]
        touch(stale)  # last: the write lock from here to the commit only
        return found[:k]

    @staticmethod
    def _similarity(s: Session, seqs: list[int], vector: list[float]) -> dict[int, float]:
        """Cosine similarity of chunks BM25 alone found: every result has one score."""
        import numpy as np

        q = np.asarray(vector, dtype=np.float32)
        rows = s.execute(select(Chunk.seq, Chunk.embedding).where(Chunk.seq.in_(seqs))).all()
        return {seq: float(np.frombuffer(blob, dtype=np.float32) @ q) for seq, blob in rows}

    @staticmethod
    def _found(s: Session, seqs: list[int], scores: dict[int, float]) -> list[Found]:
        if not seqs:
            return []
        chunks = {c.seq: c for c in s.scalars(select(Chunk).where(Chunk.seq.in_(seqs)))}
        files = {c.file_id for c in chunks.values()}
        names = dict(
            s.execute(
                select(StoredFile.id, StoredFile.filename).where(StoredFile.id.in_(files))
            ).all()
        )
        attrs = {
            (r.store_id, r.file_id): r.attributes or {}
            for r in s.scalars(select(VectorStoreFile).where(VectorStoreFile.file_id.in_(files)))
        }
        out = []
        for seq in seqs:
            c = chunks.get(seq)
            if c is None:  # deleted between the index's answer and this read
                continue
            name = names.get(c.file_id, c.file_id)
            attributes = attrs.get((c.store_id, c.file_id), {})
            out.append(Found(seq, c.file_id, name, round(scores[seq], 6), attributes, c.text))
        return out

    def drop_chunks(self, s: Session, store_id: str, file_id: str | None) -> None:
        """The chunks of this file in this store (every file's when None), from the
        table and both indexes; the store's version moves on."""
        where = [Chunk.store_id == store_id]
        if file_id is not None:
            where.append(Chunk.file_id == file_id)
        seqs = list(s.scalars(select(Chunk.seq).where(*where)))
        if seqs:
            self.index.delete(s, store_id, seqs)
            self.lexical.delete(s, seqs)
            s.execute(delete(Chunk).where(*where))
        s.execute(
            update(VectorStore)
            .where(VectorStore.id == store_id)
            .values(version=VectorStore.version + 1)
        )

    def forget(self, s: Session, file_id: str) -> None:
        """A deleted file leaves every store it was in, chunks and all (in the
        transaction that deletes it: the Files API's store calls this)."""
        rows = s.scalars(select(VectorStoreFile).where(VectorStoreFile.file_id == file_id))
        for row in list(rows):
            self.drop_chunks(s, row.store_id, file_id)
            s.delete(row)

    async def thread_store(
        self, who: Caller | None, name: str, file_ids: list[str], days: int = 7
    ) -> str:
        """A new store holding these files (queued for indexing), as OpenAI makes one for
        a thread whose messages bring files: it expires after `days` of no use."""

        def work(s: Session) -> str:
            store = new_store(
                s, who, name=name, expires_after={"anchor": "last_active_at", "days": days}
            )
            queue_files(
                s,
                store,
                [{"file_id": f} for f in file_ids],
                None,
                who,
                self.config.max_files_per_store,
            )
            return store.id

        made = await self.db.work(work)
        self.ingestor.poke()
        return made

    async def add_files(self, store_id: str, file_ids: list[str], who: Caller | None) -> None:
        """Queue more files in a store `who` may use (a thread's own, say)."""

        def work(s: Session) -> None:
            store = find(s, VectorStore, store_id, who)
            queue_files(
                s,
                store,
                [{"file_id": f} for f in file_ids],
                None,
                who,
                self.config.max_files_per_store,
            )

        await self.db.work(work)
        self.ingestor.poke()

    async def usable(self, store_ids: list[str], who: Caller | None) -> None:
        """404 unless `who` may search every one of these stores."""

        def work(s: Session) -> None:
            for store_id in store_ids:
                find(s, VectorStore, store_id, who)

        await self.db.work(work)

    async def wait_indexed(self, store_ids: list[str], timeout_s: float) -> int:
        """Wait until no file of these stores is being indexed, or `timeout_s` passed (a
        run searches what there is then, as OpenAI's waits for its stores); the files
        still in progress."""
        self.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left = await self.db.work(pending, store_ids)
            if not left or asyncio.get_running_loop().time() >= deadline:
                return left
            await asyncio.sleep(0.2)

    def start(self) -> None:
        """Index in the background from now (idempotent)."""
        self.ingestor.start()

    async def stop(self) -> None:
        await self.ingestor.stop()
        await asyncio.to_thread(self.db.close)


def retrieval_needed(retrieval: "Retrieval | None") -> "Retrieval":
    if retrieval is None:
        raise NotFoundError(
            "vector stores are turned off on this server (they need `files` and `embeddings`)"
        )
    return retrieval
