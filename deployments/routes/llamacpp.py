"""llama.cpp server endpoints: /health, /slots, /props, /tokenize, /detokenize.

A llama.cpp "slot" is one sequence the server decodes in parallel; here each model
replica has `max_num_seqs` of them (see LLMEngine.slots).
"""

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.sampling import SamplingParams
from deployments.errors import openai_error


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] = Field(max_length=1_000_000)
    model: str | None = None


class Unavailable(ShoalError):
    status_code = 503
    error_type = "unavailable_error"


def build_router(get_ingress: Callable[[], Any]) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(include_slots: bool = False, fail_on_no_slot: bool = False):  # noqa: ANN202
        ingress = get_ingress()
        body: dict[str, Any] = {"status": "ok"}
        if not (include_slots or fail_on_no_slot):
            return body  # liveness only: no replica round trip
        slots = await _all_slots(ingress)
        idle = sum(1 for s in slots if not s["is_processing"])
        body.update(slots_idle=idle, slots_processing=len(slots) - idle)
        if include_slots:
            body["slots"] = slots
        if idle == 0:
            body["status"] = "no slot available"
            if fail_on_no_slot:
                return openai_error(503, "no slot available", code="no_slot_available")
        return body

    @router.get("/slots")
    async def slots(model: str | None = None) -> list[dict]:
        ingress = get_ingress()
        name = ingress.default_model(model)
        return await ingress.model_calls[name].slots.remote()

    @router.get("/props")
    async def props(model: str | None = None) -> dict:
        ingress = get_ingress()
        name = ingress.default_model(model)
        cfg = ingress.config.model(name)
        tokenizer = ingress.tokenizers[name]
        defaults = SamplingParams(max_tokens=ingress.config.max_tokens_default)
        return {
            "model": name,
            "model_path": cfg.engine.model,
            "total_slots": cfg.engine.max_num_seqs * cfg.num_replicas,
            "default_generation_settings": {
                "n_ctx": cfg.engine.max_model_len,
                "params": defaults.model_dump(mode="json"),
            },
            "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
        }

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        ingress = get_ingress()
        name = ingress.default_model(req.model)
        ids = await ingress.tokenizer.encode.remote(name, req.content, req.add_special)
        if not req.with_pieces:
            return {"tokens": ids}
        tokenizer = ingress.tokenizers[name]
        return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        ingress = get_ingress()
        name = ingress.default_model(req.model)
        tokenizer = ingress.tokenizers[name]
        bad = next((t for t in req.tokens if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary", "tokens")
        return {"content": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return router


async def _all_slots(ingress: Any) -> list[dict]:
    out = []
    for name in ingress.models:
        try:
            out += await ingress.model_calls[name].slots.remote()
        except Exception as exc:  # the replica is down or starting
            raise Unavailable(f"model {name!r} is not available: {exc}") from None
    return out
