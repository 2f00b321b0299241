"""Ollama's /api/create on the operator's machinery: a named model made from one already
on the server (`from`: a served model's or a started alias's name, the model package
`default`, a GGUF file or model directory under the operator's models_dir, or a
downloaded Hub repo), started under its new name as /api/pull starts what it pulls.

Blob uploads (`files` with `POST /api/blobs/sha256:...`) are not supported: a GGUF is
put under models_dir (a volume, a copy) and named in `from`.
"""

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError
from deployments.api.ollama.models import _lines, begin, loaded, split_name
from deployments.api.operator_calls import OperatorAction, manage
from deployments.ingress import Ingress, IngressDep

router = APIRouter()


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    model: str | None = Field(None, max_length=300)
    name: str | None = Field(None, max_length=300)  # older clients
    from_: str | None = Field(None, alias="from", max_length=1024)
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    quantize: str | None = Field(None, max_length=32)
    stream: bool = True


@router.post("/api/create", dependencies=[OperatorAction])
async def create(req: CreateRequest, ingress: IngressDep):  # noqa: ANN201 (stream or JSON)
    alias = (req.model or req.name or "").removesuffix(":latest")
    if not alias:
        raise InvalidRequestError("model is required", param="model")
    if req.files or req.adapters:
        # A 400 that says so, as every field this server does not honour (docs/apis.md).
        raise InvalidRequestError(
            "blob uploads are not supported here: put the GGUF under the server's models_dir "
            "and name it in `from`"
        )
    if req.quantize:
        raise InvalidRequestError("quantize: models are served as they are", param="quantize")
    if not req.from_:
        raise InvalidRequestError("`from` is required (a model, or a path under models_dir)")
    repo, file_path = await _source(ingress, req.from_)
    await begin(ingress, alias, repo, file_path)  # refused here: an HTTP error
    steps = _create(ingress, alias, repo, file_path)
    if req.stream:
        return StreamingResponse(_lines(steps), media_type="application/x-ndjson")
    return [step async for step in steps][-1]


async def _source(ingress: Ingress, name: str) -> tuple[str, str | None]:
    """(modelRepo, filePath) for the operator from `from`: an alias started at run time
    is made again from what it was made from; anything else is a source itself."""
    base = name.removesuffix(":latest")
    started = await manage(ingress, "inference.list", base)
    if started:
        return started[0]["modelRepo"], started[0]["filePath"] or None
    configured = ingress.config.model(base)
    if configured is not None:  # the operator starts a configured model's weights by name
        return base, None
    if base.startswith(("/", "~")) or base.endswith(".gguf"):
        return base, None  # a path (its `:` is no tag)
    repo, file_path, _ = split_name(base)
    return repo, file_path


async def _create(ingress: Ingress, alias: str, repo: str, file_path: str | None):  # noqa: ANN202
    kind = "GGUF" if (file_path or repo).endswith(".gguf") else "model"
    yield {"status": f"parsing {kind}"}
    step: dict[str, Any] = {}
    async for step in loaded(ingress, alias):
        if step["status"] == "success":
            yield {"status": "writing manifest"}
        yield step
