"""Ingestor: indexes the files added to vector stores, in the background of each ingress.

A vector store file starts `in_progress` with no lease. Any ingress may claim it: the
claim is a compare-and-set of its `leased_at`, so two ingresses never index one file at
once. The claimant extracts the file's text (retrieval/extract.py), chunks it in the
Embedder's tokens, embeds the chunks in batches (renewing its lease after each) and then,
in one transaction, writes every chunk and its vector and marks the file `completed`:
a store holds a file whole or not at all. An ingress that dies mid-file leaves its lease
to expire; another (or itself, restarted) takes the file up again from the start. A file
removed or cancelled meanwhile is dropped at the commit, which re-reads its row.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from deployments.files_config import FilesConfig
from deployments.retrieval.extract import HTML, PDF, ExtractionError, extract_text
from deployments.retrieval.extract_child import extract_in_child
from deployments.retrieval.index import Index, pack
from deployments.retrieval.lexical import LexicalIndex
from deployments.state.database import Database
from deployments.state.files import Chunk, StoredFile, VectorStore, VectorStoreFile

logger = logging.getLogger("ray.serve")
IDLE_POLL_S = 2.0  # how often an idle ingestor looks for files whose lease ran out


@dataclass
class Lease:
    """A file this ingestor indexes: its row's `seq` and the `leased_at` it last wrote."""

    seq: int
    mark: float
    lost: bool = False
    # Renewals and the commit take turns: a renewal moves `mark` inside its transaction,
    # which a commit running beside it would read as someone else's lease.
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class Lost(Exception):
    """The file was removed, cancelled or taken over while it was being indexed."""


class Failed(Exception):
    """The file cannot be indexed: its vector store file ends `failed` with this error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message}


class Ingestor:
    def __init__(
        self,
        db: Database,
        index: Index,
        lexical: LexicalIndex,
        embedder: Any,
        config: FilesConfig,
        locate: Callable[[str], Path],
    ) -> None:
        self.db, self.index, self.lexical = db, index, lexical
        self.embedder, self.config = embedder, config
        self.locate = locate  # a file's id -> where its bytes are
        self.lease_s = config.ingest_lease_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.indexed = 0  # files this ingestor completed (tests, logs)

    def start(self) -> None:
        """Run on this event loop, unless running already (idempotent: every request that
        may need it calls it, since an app served without its lifespan never starts it)."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._loop())

    def poke(self) -> None:
        """A file was added: look now rather than at the next poll."""
        self.start()
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                job = await self.db.work(self._claim)
            except Exception:  # noqa: BLE001 (the database away for a moment: try again)
                logger.exception("ingestor: claiming a file failed")
                job = None
            if job is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                continue
            await self.index_one(job)

    def _claim(self, s: Session) -> Lease | None:
        """The oldest waiting file whose lease ran out (or never was), leased to us."""
        stale = time.time() - self.lease_s
        found = s.execute(
            select(VectorStoreFile.seq, VectorStoreFile.leased_at)
            .where(VectorStoreFile.status == "in_progress", VectorStoreFile.leased_at < stale)
            .order_by(VectorStoreFile.seq)
            .limit(1)
        ).first()
        if found is None:
            return None
        lease = Lease(found.seq, time.time())
        return lease if _move(s, lease, found.leased_at) else None

    async def index_one(self, lease: Lease) -> None:
        keeper = asyncio.get_running_loop().create_task(self._keep(lease))
        try:
            entry = await self.db.work(lambda s: _entry(s, lease.seq))
            if entry is None:
                return
            store_id, file_id, chunking, media_type = entry
            chunks, vectors = await self._chunks(lease, file_id, media_type, chunking)
            async with lease.turn:
                done = await self.db.work(self._commit, lease, store_id, chunks, vectors)
            if done:
                self.indexed += 1
                logger.info("indexed %s into %s: %d chunks", file_id, store_id, len(chunks))
        except Failed as exc:
            async with lease.turn:
                await self.db.work(self._fail, lease, exc.error)
        except Lost:
            logger.info("vector store file %s: removed, cancelled or taken over", lease.seq)
        except asyncio.CancelledError:
            raise  # the ingress stops: the lease runs out and another takes the file
        except Exception as exc:  # noqa: BLE001 (an Embedder error, a bug: said, not lost)
            # The log has the detail; the API says only what kind (no SQL, no paths).
            logger.exception("ingestor: file %s failed", lease.seq)
            error = {"code": "server_error", "message": f"indexing failed ({type(exc).__name__})"}
            async with lease.turn:
                await self.db.work(self._fail, lease, error)
        finally:
            keeper.cancel()

    async def _keep(self, lease: Lease) -> None:
        """Renew the lease while the file is being indexed, so that no other ingress
        takes it up; a renewal that finds it gone marks it lost."""
        while not lease.lost:
            await asyncio.sleep(self.lease_s / 3)
            try:
                async with lease.turn:
                    renewed = await self.db.work(_move, lease, lease.mark, time.time())
            except Exception:  # noqa: BLE001 (the database away: the next tick tries again)
                logger.warning("ingestor: renewing the lease of %s failed", lease.seq)
                continue
            lease.lost = not renewed

    async def _chunks(
        self, lease: Lease, file_id: str, media_type: str | None, chunking: dict
    ) -> tuple[list[tuple[str, list[int]]], list[list[float]]]:
        if media_type is None:
            raise Failed("invalid_file", f"file {file_id} no longer exists")
        try:
            # HTML and PDF parse in a child bounded in time and memory (extract_child.py);
            # text is only decoded, here.
            read = extract_in_child if _parsed(media_type) else extract_text
            text = await asyncio.to_thread(
                read, self.locate(file_id), media_type, self.config.max_text_chars
            )
        except ExtractionError as exc:
            raise Failed(exc.code, exc.message) from None
        except FileNotFoundError:
            raise Failed("invalid_file", f"file {file_id}'s bytes are missing") from None
        if not text.strip():  # a scan without a text layer, a bomb pypdf stopped
            raise Failed("invalid_file", f"file {file_id} has no text to index")
        size, overlap = chunking["max_chunk_size_tokens"], chunking["chunk_overlap_tokens"]
        chunks = await self.embedder.chunk.remote(text, size, overlap)
        if not chunks:  # zero-width or control characters only: nothing the model reads
            raise Failed("invalid_file", f"file {file_id} has no text to index")
        if len(chunks) > self.config.max_chunks_per_file:
            raise Failed(
                "invalid_file",
                f"file {file_id} makes {len(chunks):,} chunks; a file may make at most "
                f"{self.config.max_chunks_per_file:,}",
            )
        vectors: list[list[float]] = []
        step = self.config.embed_batch
        for start in range(0, len(chunks), step):
            if lease.lost:
                raise Lost
            vectors += await self.embedder.embed_passages.remote(
                [c[1] for c in chunks[start : start + step]]
            )
        return chunks, vectors

    def _commit(
        self,
        s: Session,
        lease: Lease,
        store_id: str,
        chunks: list[tuple[str, list[int]]],
        vectors: list[list[float]],
    ) -> bool:
        # The status changes first, as a compare-and-set: its write takes the database's
        # lock (SQLite's, the row's on PostgreSQL), so a cancel or a delete that landed
        # since the lease was checked makes this roll back instead of being overwritten.
        usage = sum(
            len(text.encode()) + 4 * len(vector)
            for (text, _), vector in zip(chunks, vectors, strict=True)
        )
        done = s.execute(
            update(VectorStoreFile)
            .where(
                VectorStoreFile.seq == lease.seq,
                VectorStoreFile.status == "in_progress",
                VectorStoreFile.leased_at == lease.mark,
            )
            .values(status="completed", usage_bytes=usage)
        ).rowcount
        if not done:
            raise Lost
        file_id = s.scalar(select(VectorStoreFile.file_id).where(VectorStoreFile.seq == lease.seq))
        made = [
            Chunk(
                store_id=store_id,
                file_id=file_id,
                position=i,
                text=text,
                tokens=len(ids),
                embedding=pack(vector),
            )
            for i, ((text, ids), vector) in enumerate(zip(chunks, vectors, strict=True))
        ]
        s.add_all(made)
        s.flush()
        self.index.add(s, store_id, made)
        self.lexical.add(s, store_id, made)
        _touch(s, store_id)
        return True

    def _fail(self, s: Session, lease: Lease, error: dict) -> None:
        failed = s.execute(
            update(VectorStoreFile)
            .where(
                VectorStoreFile.seq == lease.seq,
                VectorStoreFile.status == "in_progress",
                VectorStoreFile.leased_at == lease.mark,
            )
            .values(status="failed", last_error=error)
        ).rowcount
        if failed:
            logger.warning("vector store file %s failed: %s", lease.seq, error["message"])


def _parsed(media_type: str) -> bool:
    return media_type.partition(";")[0].strip().lower() in (HTML, PDF)


def _move(s: Session, lease: Lease, old: float, new: float | None = None) -> bool:
    """Compare-and-set of the row's lease from `old` to `new` (default: lease.mark)."""
    new = lease.mark if new is None else new
    moved = s.execute(
        update(VectorStoreFile)
        .where(
            VectorStoreFile.seq == lease.seq,
            VectorStoreFile.leased_at == old,
            VectorStoreFile.status == "in_progress",
        )
        .values(leased_at=new)
    ).rowcount
    if moved:
        lease.mark = new
    return bool(moved)


def _entry(s: Session, seq: int) -> tuple[str, str, dict, str | None] | None:
    row = s.get(VectorStoreFile, seq)
    if row is None:
        return None
    file = s.query(StoredFile).filter_by(id=row.file_id).one_or_none()
    return row.store_id, row.file_id, dict(row.chunking), file.media_type if file else None


def _touch(s: Session, store_id: str) -> None:
    """The store's chunks changed: a new version (cached matrices are stale)."""
    s.execute(
        update(VectorStore)
        .where(VectorStore.id == store_id)
        .values(version=VectorStore.version + 1, last_active_at=int(time.time()))
    )
