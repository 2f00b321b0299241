"""OpenAI's Files API: POST /v1/files (a multipart upload), GET /v1/files (a cursor list),
GET /v1/files/{id}, GET /v1/files/{id}/content (the bytes) and DELETE /v1/files/{id}.

The store (store.py) keeps rows in the app's database and bytes under `files.data_dir`,
which every ingress replica must share; it is on `app.state.files`, where retrieval
finds a file's bytes too (`FilesStore.on_disk`). A key sees only its own files (another
key's id is a 404); an admin key sees all.
"""

import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from app.protocol.errors import InvalidRequestError, NotFoundError, ShoalError
from deployments.api.files.store import FilesStore
from deployments.http.caller import Caller, caller_of
from deployments.ingress import Ingress
from deployments.state.database import Database

logger = logging.getLogger("ray.serve")
router = APIRouter(prefix="/v1")

PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds: an hour to 30 days
BATCH_EXPIRES_AFTER_S = 30 * 24 * 3600  # as OpenAI: batch files go after 30 days unless told
MAX_FILENAME_CHARS = 512  # the column's width
READ_BYTES = 1 << 20  # an upload is copied to its place a MiB at a time
PAGE_MAX = 100  # a list page holds at most this many (the database's page); `after` goes on
# The bytes are served to be saved, never shown: an uploaded page's scripts must not run
# as this server's origin (which may hold a loopback operator's rights).
CONTENT_HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"}


def install(app: FastAPI, ingress: Ingress) -> None:
    config = ingress.config.files
    if not config.enabled:
        return
    db = Database(ingress.config.database.sqlalchemy_url())
    store = app.state.files = FilesStore(db, config)
    logger.info("files ready: bytes in %s", store.dir)

    async def stop() -> None:  # Serve runs the app's shutdown when the replica stops
        store.close()

    app.router.on_shutdown.append(stop)


def files_of(request: Request) -> FilesStore:
    store = getattr(request.app.state, "files", None)
    if store is None:
        raise NotFoundError("the Files API is turned off on this server")
    return store


FilesDep = Annotated[FilesStore, Depends(files_of)]
WhoDep = Annotated[Caller, Depends(caller_of)]  # a key sees only the files it uploaded


@router.post("/files")
async def create_file(
    files: FilesDep,
    who: WhoDep,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
    anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> dict:
    if purpose not in PURPOSES:
        raise InvalidRequestError(
            f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}", param="purpose"
        )
    expires_after_s = _expires_after(purpose, anchor, seconds)
    name = _filename(file.filename)
    return await files.create_file(_chunks(file), name, purpose, expires_after_s, who)


@router.get("/files")
async def list_files(
    files: FilesDep,
    who: WhoDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict:
    # OpenAI's pages go to 10,000; ours stop at 100 with `has_more`, which every
    # client (the SDK's auto-paging too) follows with `after`.
    return await files.list_files(who, purpose, min(limit, PAGE_MAX), order, after)


@router.get("/files/{file_id}")
async def get_file(file_id: str, files: FilesDep, who: WhoDep) -> dict:
    return await files.get_file(file_id, who)


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, files: FilesDep, who: WhoDep) -> FileResponse:
    stored = await files.on_disk(file_id, who)
    if not stored.path.is_file():  # a data_dir that this replica does not share
        logger.error("files: %s has a row but no bytes at %s", file_id, stored.path)
        raise ShoalError(f"the bytes of {file_id} are missing from this server's files.data_dir")
    return FileResponse(
        stored.path,
        media_type=stored.media_type,
        filename=stored.filename,
        headers=CONTENT_HEADERS,
        content_disposition_type="attachment",
    )


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, files: FilesDep, who: WhoDep) -> dict:
    return await files.delete_file(file_id, who)


def _expires_after(purpose: str, anchor: str | None, seconds: int | None) -> int | None:
    """Seconds from creation to expiry, as OpenAI's `expires_after` says them."""
    if anchor is None and seconds is None:
        return BATCH_EXPIRES_AFTER_S if purpose == "batch" else None
    if anchor != "created_at":
        raise InvalidRequestError(
            "expires_after[anchor] must be 'created_at'", param="expires_after.anchor"
        )
    low, high = EXPIRES_AFTER_S
    if seconds is None or not low <= seconds <= high:
        raise InvalidRequestError(
            f"expires_after[seconds] must be between {low} and {high}",
            param="expires_after.seconds",
        )
    return seconds


def _filename(raw: str | None) -> str:
    """The name the client gave, less any folders (some clients send a whole path) and
    control characters (PostgreSQL refuses a NUL in text; none means anything in a name)."""
    name = re.sub(r"[\x00-\x1f\x7f]", "", re.split(r"[/\\]", raw or "")[-1]).strip()
    if not name:
        raise InvalidRequestError("the uploaded file needs a filename", param="file")
    if len(name) > MAX_FILENAME_CHARS:
        raise InvalidRequestError(
            f"a filename is at most {MAX_FILENAME_CHARS} characters", param="file"
        )
    return name


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(READ_BYTES):
        yield chunk
