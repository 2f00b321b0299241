"""Ollama's model management on the operator's machinery: /api/pull downloads a Hub repo
and starts it under its own name (so `ollama pull` then `ollama run` works), /api/delete
stops that alias and deletes its files. /api/ps and /api/tags (ollama.py) list the
aliases with the configured models.

Names: `owner/repo` (optionally `hf.co/owner/repo`) pulls the whole repo; a tag that names
a file (`owner/repo:model.Q4_0.gguf`) pulls that file alone; `:latest` is no tag.
"""

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError, NotFoundError, ShoalError
from deployments.api.ollama.routes import ollama_error
from deployments.api.operator_calls import OperatorAction, manage
from deployments.ingress import Ingress, IngressDep

POLL_S = 0.5
router = APIRouter()


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, max_length=300)
    name: str | None = Field(None, max_length=300)  # older clients
    stream: bool = True
    insecure: bool = False


def split_name(name: str | None) -> tuple[str, str | None, str]:
    """(modelRepo, filePath or None, alias) from an Ollama model name."""
    if not name:
        raise InvalidRequestError("model is required", param="model")
    base = name.removeprefix("hf.co/").removeprefix("huggingface.co/")
    repo, _, tag = base.partition(":")
    file_path = None if tag in ("", "latest") else tag
    if file_path is not None and "." not in file_path:
        raise InvalidRequestError(f"tag {tag!r}: name a file in the repo, or no tag", "model")
    return repo, file_path, name.removesuffix(":latest")


@router.post("/api/pull", dependencies=[OperatorAction])
async def pull(req: PullRequest, ingress: IngressDep):  # noqa: ANN201 (stream or JSON)
    name = (req.model or req.name or "").removesuffix(":latest")
    if ingress.find_model(name) is not None:  # served already (configured, or pulled)
        steps = _already(name)
    else:
        repo, file_path, alias = split_name(req.model or req.name)
        steps = _pull(ingress, repo, file_path, alias)
    if req.stream:
        return StreamingResponse(_lines(steps), media_type="application/x-ndjson")
    steps_taken = [step async for step in steps]
    return steps_taken[-1]


async def _lines(steps: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for step in steps:
            yield json.dumps(step) + "\n"
    except ShoalError as exc:
        yield json.dumps(ollama_error(exc)) + "\n"


async def _already(name: str):  # noqa: ANN202
    yield {"status": "pulling manifest"}
    yield {"status": "success"}


async def _pull(ingress: Ingress, repo: str, file_path: str | None, alias: str):  # noqa: ANN202
    yield {"status": "pulling manifest"}
    item = await manage(ingress, "downloads.enqueue", repo, file_path)
    while item["status"] in ("queued", "downloading"):
        digest = f"sha256:{json.loads(item['metadata']).get('commit') or ''}"
        yield {
            "status": f"pulling {repo}",
            "digest": digest,
            "total": item["totalBytes"],
            "completed": item["downloadedBytes"],
        }
        await asyncio.sleep(POLL_S)
        items = await manage(ingress, "downloads.list", repo, file_path or "")
        if not items:
            raise NotFoundError(f"the download of {repo} was reset")
        item = items[0]
    if item["status"] != "complete":
        raise ShoalError(f"pulling {repo} ended {item['status']}: {item['error']}")
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    async for step in load(ingress, alias, repo, file_path):
        yield step


async def load(ingress: Ingress, alias: str, repo: str, file_path: str | None):  # noqa: ANN201
    """Start `alias` from `repo` (a download, a model package, a path under models_dir)
    unless it is served or starting already, and wait until it serves."""
    await begin(ingress, alias, repo, file_path)
    async for step in loaded(ingress, alias):
        yield step


async def begin(ingress: Ingress, alias: str, repo: str, file_path: str | None) -> None:
    """Start `alias` unless it is served or on its way (a refusal is raised here)."""
    if ingress.find_model(alias) is not None:
        return
    running = await manage(ingress, "inference.list", alias)
    if not running or running[0]["status"] not in ("queued", "preparing", "inferring"):
        if running:
            await manage(ingress, "inference.reset", alias)
        await manage(ingress, "inference.start_alias", alias, repo, file_path, 0, 0, "")


async def loaded(ingress: Ingress, alias: str):  # noqa: ANN201
    """Steps until `alias` (started) serves; its failure is raised."""
    if ingress.find_model(alias) is None:
        yield {"status": "loading model"}
        while ingress.find_model(alias) is None:
            items = await manage(ingress, "inference.list", alias)
            if not items or items[0]["status"] in ("error", "complete"):
                reason = items[0]["error"] if items else "it was removed"
                raise ShoalError(f"{alias} could not start: {reason}")
            await asyncio.sleep(POLL_S)
    yield {"status": "success"}


class DeleteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(None, max_length=300)
    name: str | None = Field(None, max_length=300)


@router.delete("/api/delete", dependencies=[OperatorAction])
async def delete(req: DeleteRequest, ingress: IngressDep) -> dict:
    repo, file_path, alias = split_name(req.model or req.name)
    if ingress.config.model(alias) is not None:
        raise InvalidRequestError(f"'{alias}' is configured: it cannot be deleted", "model")
    found = False
    if await manage(ingress, "inference.list", alias):
        await manage(ingress, "inference.reset", alias)
        found = True
    if await manage(ingress, "downloads.list", repo, file_path or ""):
        await manage(ingress, "downloads.reset", repo, file_path)
        found = True
    if not found:
        raise NotFoundError(f"model '{alias}' not found", param="model")
    return {}
