"""OpenAI's Vector Stores API: /v1/vector_stores, its files, file batches and search.

Retrieval (deployments/retrieval/service.py) is made here at start-up, when both files
and embeddings are on, and kept on the app's state, where Assistants' and Responses'
`file_search` find it too. Each ingress runs an ingestor that indexes the files added
here in the background; any ingress's ingestor may take up a file another left."""

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Request

from deployments.api.cursor import CursorDep
from deployments.api.vector_stores.schema import (
    BatchCreate,
    FileCreate,
    FileUpdate,
    SearchRequest,
    StoreCreate,
    StoreUpdate,
    chunking_of,
)
from deployments.api.vector_stores.store import VectorStoresStore
from deployments.http.caller import Caller, caller_of
from deployments.ingress import Ingress
from deployments.retrieval.service import Retrieval, retrieval_needed

logger = logging.getLogger("ray.serve")
router = APIRouter(prefix="/v1/vector_stores")
FileStatus = Literal["in_progress", "completed", "failed", "cancelled"]


def install(app: FastAPI, ingress: Ingress) -> None:
    config = ingress.config
    if not config.files.enabled or ingress.embedder is None:
        app.state.retrieval = None
        return
    retrieval = Retrieval(config.database.sqlalchemy_url(), config.files, ingress.embedder)
    app.state.retrieval = retrieval
    app.state.vector_stores = VectorStoresStore(retrieval)
    files = getattr(app.state, "files", None)  # the Files API's store, installed before
    if files is not None:  # a deleted or expired file takes its chunks with it
        files.forget = retrieval.forget
    logger.info("vector index: %s", retrieval.index.kind)
    app.router.on_startup.append(retrieval.start)
    app.router.on_shutdown.append(retrieval.stop)


async def _store(request: Request) -> VectorStoresStore:
    retrieval_needed(getattr(request.app.state, "retrieval", None)).start()
    return request.app.state.vector_stores


StoreDep = Annotated[VectorStoresStore, Depends(_store)]
WhoDep = Annotated[Caller, Depends(caller_of)]


def _entry(f: FileCreate) -> dict:
    return {
        "file_id": f.file_id,
        "chunking": chunking_of(f.chunking_strategy),
        "attributes": f.attributes,
    }


# ---- stores ----------------------------------------------------------------------------
@router.post("")
async def create(req: StoreCreate, store: StoreDep, who: WhoDep) -> dict:
    fields = {"name": req.name, "meta": req.metadata or {}}
    if req.expires_after is not None:
        fields["expires_after"] = req.expires_after.model_dump()
    chunking = chunking_of(req.chunking_strategy)
    entries = [{"file_id": f, "chunking": chunking} for f in req.file_ids]
    return await store.create(fields, entries, who)


@router.get("")
async def list_stores(store: StoreDep, cursor: CursorDep, who: WhoDep) -> dict:
    return await store.list_stores(who, **cursor.args)


@router.get("/{store_id}")
async def get(store_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.get(store_id, who)


@router.post("/{store_id}")
async def update(store_id: str, req: StoreUpdate, store: StoreDep, who: WhoDep) -> dict:
    fields: dict = {}
    if "name" in req.model_fields_set:
        fields["name"] = req.name
    if "metadata" in req.model_fields_set:
        fields["meta"] = req.metadata or {}
    if "expires_after" in req.model_fields_set:
        fields["expires_after"] = req.expires_after.model_dump() if req.expires_after else None
    return await store.update(store_id, fields, who)


@router.delete("/{store_id}")
async def delete(store_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.delete(store_id, who)


@router.post("/{store_id}/search")
async def search(
    store_id: str, req: SearchRequest, store: StoreDep, request: Request, who: WhoDep
) -> dict:
    await store.searchable(store_id, who)
    retrieval: Retrieval = request.app.state.retrieval
    ranking = req.ranking_options
    found = await retrieval.search(
        [store_id],
        req.text(),
        req.max_num_results,
        threshold=ranking.score_threshold if ranking else 0.0,
        hybrid=ranking is None or ranking.ranker != "none",
        filters=req.filters,
    )
    return {
        "object": "vector_store.search_results.page",
        "search_query": [req.text()],
        "data": [f.as_api() for f in found],
        "has_more": False,
        "next_page": None,
    }


# ---- files -----------------------------------------------------------------------------
@router.post("/{store_id}/files")
async def add_file(store_id: str, req: FileCreate, store: StoreDep, who: WhoDep) -> dict:
    return await store.add_file(store_id, _entry(req), who)


@router.get("/{store_id}/files")
async def list_files(
    store_id: str,
    store: StoreDep,
    cursor: CursorDep,
    who: WhoDep,
    filter: FileStatus | None = None,  # noqa: A002 (OpenAI's name for it)
) -> dict:
    return await store.list_files(store_id, who, filter, **cursor.args)


@router.get("/{store_id}/files/{file_id}")
async def get_file(store_id: str, file_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.get_file(store_id, file_id, who)


@router.post("/{store_id}/files/{file_id}")
async def update_file(
    store_id: str, file_id: str, req: FileUpdate, store: StoreDep, who: WhoDep
) -> dict:
    return await store.update_file(store_id, file_id, req.attributes, who)


@router.get("/{store_id}/files/{file_id}/content")
async def file_content(store_id: str, file_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.file_content(store_id, file_id, who)


@router.delete("/{store_id}/files/{file_id}")
async def delete_file(store_id: str, file_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.delete_file(store_id, file_id, who)


# ---- file batches ----------------------------------------------------------------------
@router.post("/{store_id}/file_batches")
async def create_batch(store_id: str, req: BatchCreate, store: StoreDep, who: WhoDep) -> dict:
    entries = [_entry(f) for f in req.entries()]
    return await store.create_batch(store_id, entries, who)


@router.get("/{store_id}/file_batches/{batch_id}")
async def get_batch(store_id: str, batch_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.get_batch(store_id, batch_id, who)


@router.post("/{store_id}/file_batches/{batch_id}/cancel")
async def cancel_batch(store_id: str, batch_id: str, store: StoreDep, who: WhoDep) -> dict:
    return await store.cancel_batch(store_id, batch_id, who)


@router.get("/{store_id}/file_batches/{batch_id}/files")
async def batch_files(
    store_id: str,
    batch_id: str,
    store: StoreDep,
    cursor: CursorDep,
    who: WhoDep,
    filter: FileStatus | None = None,  # noqa: A002
) -> dict:
    return await store.list_files(store_id, who, filter, batch_id, **cursor.args)
