"""FilesStore: OpenAI's Files as rows of the app's database (`StoredFile`) and bytes under
`files.data_dir`, one file named by each id.

An upload is written to a hidden temporary name in that same folder, counted as it
arrives, sniffed, then renamed to its id (a rename within a folder is atomic: a half-
written file is never seen under an id) and only then given its row, in the transaction
that checks its owner's total. A row therefore always has its bytes; bytes without a row
(a crash between the rename and the commit) are never served, since every read starts
from a row. A file is its key's (`owner`, as state/assistants.py's OWNERS): another key's
id is a 404, and each key's files are bounded in total (`files.max_total_bytes`; the
server's as a whole when it has no keys). A file past its `expires_at` is gone: it reads
as a 404 and is deleted, row and bytes, by the next upload or list.
"""

import asyncio
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.protocol.errors import ConflictError, InvalidRequestError, NotFoundError, ShoalError
from deployments.files_config import FilesConfig
from deployments.http.caller import Caller
from deployments.retrieval.extract import (
    SNIFF_BYTES,
    UnsupportedFileError,
    declared_type,
    media_type_of,
)
from deployments.state.base import now
from deployments.state.database import Database, find, page, take_turns
from deployments.state.files import StoredFile

logger = logging.getLogger("ray.serve")
FILE_ID = re.compile(r"file-[0-9a-f]{24}")  # what `new_file_id` makes: safe as a file name
PART = ".part"  # an upload being written: `.<id>.part`, renamed to `<id>` when whole
PART_KEPT_S = 24 * 3600  # a part this old was left by a crash (no upload takes a day)
SWEPT_AT_ONCE = 1000  # expired files deleted by one sweep; the next takes the rest


class FileTooLargeError(ShoalError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "file_too_large"


class FilesQuotaError(ConflictError):
    code = "files_quota_exceeded"


@dataclass(frozen=True)
class FileOnDisk:
    """A stored file as retrieval reads it: where its bytes are and what they are."""

    id: str
    owner: str | None
    filename: str
    purpose: str
    media_type: str  # as extract.media_type_of decided it; what extract_text takes
    bytes: int
    path: Path


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"  # OpenAI's ids are `file-...`


class FilesStore:
    def __init__(self, db: Database, config: FilesConfig) -> None:
        self.db = db
        self.config = config
        self.dir = Path(config.data_dir).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._drop_stale_parts()
        # What else goes with a deleted file, in its transaction: its chunks in every
        # vector store (set by the vector stores' install, when retrieval is on).
        self.forget: Callable[[Session, str], None] | None = None

    def close(self) -> None:
        self.db.close()

    def path_of(self, file_id: str) -> Path:
        """Where the bytes of `file_id` are (or would be). Only an id this store makes
        names a path: anything else (`..`, a slash) is a 404, never a path outside."""
        if not FILE_ID.fullmatch(file_id):
            raise NotFoundError(f"No file found with id '{file_id}'.")
        return self.dir / file_id

    async def create_file(
        self,
        chunks: AsyncIterator[bytes],
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        who: Caller | None = None,
    ) -> dict:
        """Store the bytes `chunks` yields as a new file; its File object. 400 for a type
        this server does not read, 413 past `max_file_bytes`, 409 past the owner's total:
        in each case nothing is kept."""
        await self.sweep_expired()
        try:
            declared_type(filename)  # before a byte is written
        except UnsupportedFileError as exc:
            raise InvalidRequestError(exc.message, param="file") from None
        file_id = new_file_id()
        final = self.path_of(file_id)
        part = final.with_name(f".{file_id}{PART}")
        try:
            size, head = await self._receive(chunks, part)
            media_type = media_type_of(filename, head, complete=size <= len(head))
        except UnsupportedFileError as exc:
            part.unlink(missing_ok=True)
            raise InvalidRequestError(exc.message, param="file") from None
        except BaseException:  # too large, the client gone, a full disk: nothing is kept
            part.unlink(missing_ok=True)
            raise
        os.replace(part, final)
        created = now()
        row = StoredFile(
            id=file_id,
            owner=None if who is None else who.key_id,
            created_at=created,
            filename=filename,
            purpose=purpose,
            bytes=size,
            media_type=media_type,
            expires_at=None if expires_after_s is None else created + expires_after_s,
        )
        # Shielded: a client that leaves now must not cut the commit from the cleanup
        # after it (bytes kept without a row, or a row whose bytes were removed).
        return await asyncio.shield(self._commit(row, final))

    async def get_file(self, file_id: str, who: Caller | None = None) -> dict:
        return await self.db.work(lambda s: _find(s, file_id, who).as_api())

    async def on_disk(self, file_id: str, who: Caller | None = None) -> FileOnDisk:
        """The file `who` may read (None: the server itself), and where its bytes are."""
        row = await self.db.work(_find, file_id, who)
        return FileOnDisk(
            row.id,
            row.owner,
            row.filename,
            row.purpose,
            row.media_type,
            row.bytes,
            self.path_of(row.id),
        )

    async def list_files(
        self,
        who: Caller | None = None,
        purpose: str | None = None,
        limit: int = 100,
        order: str = "desc",
        after: str | None = None,
    ) -> dict:
        await self.sweep_expired()
        where = {} if purpose is None else {"purpose": purpose}
        return await self.db.work(
            lambda s: page(s, StoredFile, limit, order, after, viewer=who, **where)
        )

    async def delete_file(self, file_id: str, who: Caller | None = None) -> dict:
        """Remove the row, then the bytes: a reader that found the row a moment before
        may find no bytes (and says so); none ever finds bytes without a row."""

        def work(s: Session) -> None:
            s.delete(_find(s, file_id, who))
            if self.forget is not None:
                self.forget(s, file_id)

        await self.db.work(work)
        await asyncio.to_thread(self.path_of(file_id).unlink, missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    async def sweep_expired(self) -> int:
        """Delete files past their `expires_at` (every owner's); how many went."""

        def work(s: Session) -> list[str]:
            stmt = select(StoredFile.id).where(StoredFile.expires_at <= now())
            ids = list(s.scalars(stmt.limit(SWEPT_AT_ONCE)))
            if ids:
                s.execute(delete(StoredFile).where(StoredFile.id.in_(ids)))
                for file_id in ids if self.forget is not None else ():
                    self.forget(s, file_id)
            return ids

        ids = await self.db.work(work)
        if ids:
            await asyncio.to_thread(self._unlink, ids)
            logger.info("files: %d expired file(s) deleted", len(ids))
        return len(ids)

    # ---- the upload's steps --------------------------------------------------------------
    async def _receive(self, chunks: AsyncIterator[bytes], part: Path) -> tuple[int, bytes]:
        """Write the chunks to `part`, counting; the size and the file's first bytes."""
        limit = self.config.max_file_bytes
        size, head = 0, b""
        with part.open("xb") as out:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise FileTooLargeError(
                        f"the file is over this server's limit of {limit:,} bytes "
                        "(files.max_file_bytes)",
                        param="file",
                    )
                if len(head) < SNIFF_BYTES:
                    head += chunk[: SNIFF_BYTES - len(head)]
                await asyncio.to_thread(out.write, chunk)
            # On disk before the rename: after a crash the id names the whole file or none.
            await asyncio.to_thread(_sync, out)
        return size, head

    async def _commit(self, row: StoredFile, final: Path) -> dict:
        try:
            return await self.db.work(self._insert, row)
        except BaseException:
            final.unlink(missing_ok=True)
            raise

    def _insert(self, s: Session, row: StoredFile) -> dict:
        """Add the row, then sum its owner's files with it: past the limit, the
        transaction is undone. On SQLite the insert takes the one write lock first, so
        the sum sees every committed upload; on PostgreSQL one owner's uploads take turns
        under an advisory lock to the same end."""
        take_turns(s, f"files:{row.owner}")
        s.add(row)
        s.flush()
        total = s.scalar(select(func.sum(StoredFile.bytes)).where(StoredFile.owner == row.owner))
        limit = self.config.max_total_bytes
        if total > limit:
            whose = "this key's" if row.owner is not None else "this server's"
            raise FilesQuotaError(
                f"storing {row.bytes:,} more bytes would pass {whose} limit of {limit:,} bytes "
                f"of files ({total - row.bytes:,} stored); delete some first",
                param="file",
            )
        return row.as_api()

    def _unlink(self, ids: list[str]) -> None:
        for file_id in ids:
            self.path_of(file_id).unlink(missing_ok=True)

    def _drop_stale_parts(self) -> None:
        """Remove what crashed uploads left: parts older than any upload takes (another
        replica sharing the folder may be writing a young one now)."""
        cutoff = time.time() - PART_KEPT_S
        for part in self.dir.glob(f".file-*{PART}"):
            try:
                if part.stat().st_mtime < cutoff:
                    part.unlink()
            except FileNotFoundError:  # another replica removed it first
                continue


def _find(s: Session, file_id: str, who: Caller | None) -> StoredFile:
    """The live file `who` may see: one past its `expires_at` is as gone as a deleted one."""
    row = find(s, StoredFile, file_id, who)
    if row.expires_at is not None and row.expires_at <= now():
        raise NotFoundError(f"No file found with id '{file_id}'.")
    return row


def _sync(out: IO[Any]) -> None:
    out.flush()
    os.fsync(out.fileno())
