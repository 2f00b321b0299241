"""vLLM's LoRA routes: POST /v1/load_lora_adapter {lora_name, lora_path} and POST
/v1/unload_lora_adapter {lora_name}, answered in plain text as vLLM does, errors in
OpenAI's shape. Operator actions: an admin key, or a client on this machine when none is
set (deployments/api/operator_calls.py). `model` (Shoal's) names the base when several
are served; `lora_path` is a PEFT directory or a LoRA GGUF under the operator's
models_dir."""

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments.api.lora_calls import load_lora, unload_lora
from deployments.api.operator_calls import OperatorAction
from deployments.ingress import IngressDep

router = APIRouter()


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=1024)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name
    model: str | None = Field(None, max_length=256)


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what count here


@router.post("/v1/load_lora_adapter", dependencies=[OperatorAction])
async def load_lora_adapter(body: LoadLoraAdapter, ingress: IngressDep) -> PlainTextResponse:
    await load_lora(ingress, body.model, body.lora_name, body.lora_path, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[OperatorAction])
async def unload_lora_adapter(body: UnloadLoraAdapter, ingress: IngressDep) -> PlainTextResponse:
    await unload_lora(ingress, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
