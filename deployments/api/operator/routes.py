"""The operator API (the Wingman server's /api endpoints): the model catalog, downloads,
inference control (aliases started and stopped at run time), the cluster's hardware,
a graceful shutdown and client log lines. The state lives in the Operator deployment
(deployments/operator); these routes only validate and call it.

Errors take Ollama's shape ({"error": "..."}), as everything under /api/ does.
"""

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from deployments import context_rebalance
from deployments.api.lora_calls import listed, load_lora, unload_lora
from deployments.api.operator_calls import OperatorAction, manage, operator_call
from deployments.http.caller import caller_of
from deployments.http.host_detail import without_host_detail
from deployments.ingress import IngressDep

logger = logging.getLogger("ray.serve")
# Lines sent by clients, at their level, in the replica's log (a child of Serve's logger).
client_log = logging.getLogger("ray.serve.client")
MAX_LOG_MESSAGE = 8192

router = APIRouter()

Repo = Annotated[str, Query(alias="modelRepo", min_length=1, max_length=200)]
OptionalRepo = Annotated[str | None, Query(alias="modelRepo", max_length=200)]
FilePath = Annotated[str | None, Query(alias="filePath", max_length=512)]
Alias = Annotated[str, Query(min_length=1, max_length=128)]
# What a model started at run time loads: a Hub repo downloaded, a model package
# (`default`), or a path under models_dir (deployments/operator/sources.py).
Source = Annotated[str, Query(alias="modelRepo", min_length=1, max_length=1024)]


# ---- catalog and hardware ---------------------------------------------------------------
@router.get("/api/models")
async def models(ingress: IngressDep, request: Request) -> dict:
    return {"models": shown(request, await operator_call(ingress, "models"))}


@router.get("/api/hardware")
@router.get("/api/hardwareinfo")
async def hardware(ingress: IngressDep, request: Request) -> dict:
    return shown(request, await operator_call(ingress, "hardware"))


def shown(request: Request, found: Any) -> Any:
    """What the caller may see of it: all for the operator, else no host detail."""
    return found if caller_of(request).operator else without_host_detail(found)


# ---- downloads --------------------------------------------------------------------------
@router.get("/api/downloads")
async def downloads(
    ingress: IngressDep,
    request: Request,
    model_repo: OptionalRepo = None,
    file_path: FilePath = None,
) -> dict:
    found = await manage(ingress, "downloads.list", model_repo, file_path)
    return {"DownloadItems": shown(request, found)}


@router.get("/api/downloads/enqueue", dependencies=[OperatorAction])
async def enqueue(ingress: IngressDep, model_repo: Repo, file_path: FilePath = None) -> dict:
    return await manage(ingress, "downloads.enqueue", model_repo, file_path)


@router.get("/api/downloads/cancel", dependencies=[OperatorAction])
async def cancel(ingress: IngressDep, model_repo: Repo, file_path: FilePath = None) -> dict:
    return await manage(ingress, "downloads.cancel", model_repo, file_path)


@router.get("/api/downloads/reset", dependencies=[OperatorAction])
async def reset(ingress: IngressDep, model_repo: Repo, file_path: FilePath = None) -> dict:
    return await manage(ingress, "downloads.reset", model_repo, file_path)


# ---- inference control ------------------------------------------------------------------
@router.get("/api/inference")
async def inference(ingress: IngressDep, request: Request, alias: str | None = None) -> dict:
    return {"WingmanItems": shown(request, await manage(ingress, "inference.list", alias))}


@router.get("/api/inference/status")
async def inference_status(ingress: IngressDep, request: Request, alias: str | None = None) -> list:
    return shown(request, await manage(ingress, "inference.list", alias))


@router.get("/api/inference/start", dependencies=[OperatorAction])
async def inference_start(
    ingress: IngressDep,
    alias: Alias,
    model_repo: Source,
    file_path: FilePath = None,
    context_size: Annotated[int, Query(alias="contextSize", ge=0, le=1 << 20)] = 0,
    gpu_layers: Annotated[int, Query(alias="gpuLayers", ge=-1, le=1000)] = 0,
    chat_template: Annotated[str, Query(alias="chatTemplate", max_length=64)] = "",
    address: str = "",
    port: int = 0,
) -> dict:
    """`modelRepo`: a downloaded Hub repo, an installed model package (`default`), a
    configured model's name, or a GGUF file or model directory under models_dir.
    `address` and `port` are accepted and unused: Serve places the replicas and the
    ingress reaches them by handle; clients use the alias as `model`."""
    return await manage(
        ingress,
        "inference.start_alias",
        alias,
        model_repo,
        file_path,
        context_size,
        gpu_layers,
        chat_template,
    )


@router.get("/api/inference/stop", dependencies=[OperatorAction])
async def inference_stop(ingress: IngressDep, alias: Alias) -> dict:
    return await manage(ingress, "inference.stop", alias)


@router.get("/api/inference/reset", dependencies=[OperatorAction])
async def inference_reset(ingress: IngressDep, alias: Alias) -> dict:
    return await manage(ingress, "inference.reset", alias)


# ---- contexts moved between a model's replicas (deployments/context_rebalance.py) ------
Context = Annotated[str, Query(alias="context_id", min_length=1, max_length=256)]
Replica = Annotated[str, Query(min_length=1, max_length=256)]


@router.post("/api/inference/move", dependencies=[OperatorAction])
async def inference_move(ingress: IngressDep, alias: Alias, context: Context, to: Replica) -> dict:
    return await context_rebalance.move(ingress, ingress.model(alias).name, context, to)


@router.post("/api/inference/rebalance", dependencies=[OperatorAction])
async def inference_rebalance(ingress: IngressDep, alias: Alias) -> dict:
    return await context_rebalance.rebalance(ingress, ingress.model(alias).name)


# ---- shutdown and logs ------------------------------------------------------------------
# ---- LoRA adapters (the same as vLLM's /v1/load_lora_adapter, deployments/api/lora_calls.py)
AdapterName = Annotated[str, Query(alias="name", min_length=1, max_length=128)]


@router.get("/api/lora-adapters")
async def lora_adapters(ingress: IngressDep, request: Request) -> dict:
    """Every served model's adapters; their directories to the operator only."""
    found = listed(ingress)
    if not caller_of(request).operator:
        found = [{k: v for k, v in a.items() if k != "path"} for a in found]
    return {"adapters": found}


@router.get("/api/lora-adapters/load", dependencies=[OperatorAction])
async def lora_load(
    ingress: IngressDep,
    name: AdapterName,
    path: Annotated[str, Query(min_length=1, max_length=1024)],
    alias: Annotated[str | None, Query(max_length=256)] = None,
    replace: bool = False,
) -> dict:
    """Load the PEFT adapter at `path` (under models_dir) as `name` for the model
    `alias` names (default: the first served)."""
    model = await load_lora(ingress, alias, name, path, replace)
    return {"model": model, "name": name, "status": "loaded"}


@router.get("/api/lora-adapters/unload", dependencies=[OperatorAction])
async def lora_unload(ingress: IngressDep, name: AdapterName) -> dict:
    await unload_lora(ingress, name)
    return {"name": name, "status": "unloaded"}


@router.get("/api/shutdown", dependencies=[OperatorAction])
async def shutdown(ingress: IngressDep) -> dict:
    """Drain: no new requests; open streams finish; then the app is deleted."""
    return await operator_call(ingress, "drain", "api")


class WingmanLogItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    isa: Literal["WingmanLogItem"] = "WingmanLogItem"
    level: Literal["debug", "info", "warn", "warning", "error"] = "info"
    message: str = Field(max_length=MAX_LOG_MESSAGE)
    timestamp: int = 0


LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


@router.post("/api/utils/log", dependencies=[OperatorAction])
async def log(item: WingmanLogItem) -> dict:
    # One line per item: a client's newlines cannot forge other log lines.
    text = item.message.replace("\r", "\\r").replace("\n", "\\n")
    client_log.log(LEVELS[item.level], "client: %s", text)
    return item.model_dump()
