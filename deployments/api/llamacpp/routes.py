"""llama.cpp server endpoints: /health, /slots, /props, /tokenize, /detokenize and
POST /slots/{id}?action=save|restore|erase (generation is in llamacpp_completion.py).

A llama.cpp "slot" is one sequence the server decodes in parallel; here each model
replica has `max_num_seqs` of them (the engine's SlotInfo). A slot's prompt cache and
its files are a persistent context named `slot-{id}`.
"""

import time
from typing import Any

from fastapi import APIRouter, Request

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.messages import ContextAction
from app.protocol.outputs import ContextFile, SlotInfo
from app.protocol.sampling import SamplingParams
from deployments.api.llamacpp.schema import (
    DetokenizeRequest,
    SlotFileRequest,
    TokenizeRequest,
)
from deployments.api.prompts import MEDIA_MARKER
from deployments.api.slots import check_slot, slot_op
from deployments.http.caller import caller_of
from deployments.http.host_detail import without_host_detail
from deployments.ingress import Ingress, IngressDep

router = APIRouter()


class Unavailable(ShoalError):
    status_code = 503
    error_type = "unavailable_error"


class LoadingModel(Unavailable):
    code = "loading_model"


class NoSlot(ShoalError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_slot_available"


def slot_json(slot: SlotInfo) -> dict:
    body: dict[str, Any] = {
        "id": slot.index,
        "n_ctx": slot.max_model_len,
        "is_processing": slot.state != "idle",
        "state": "processing" if slot.state == "running" else slot.state,
    }
    if slot.request_id is not None:
        body.update(
            id_task=slot.request_id,
            n_prompt_tokens=slot.num_prompt_tokens,
            n_prompt_tokens_cached=slot.num_cached_tokens,
            n_decoded=slot.num_output_tokens,
            params=None if slot.params is None else slot.params.model_dump(mode="json"),
        )
    return body


@router.get("/health")
async def health(
    request: Request,
    ingress: IngressDep,
    include_slots: bool = False,
    fail_on_no_slot: bool = False,
) -> dict:
    """Status and slot counts for anyone; each slot's detail (its request and sampling
    settings) only with a key, when keys are set. 503 while a model has no live replica."""
    detail = include_slots and request.scope.get("state", {}).get("authenticated", True)
    if detail or ingress.registry is None:
        slots = await _all_slots(ingress)
        busy = sum(1 for s in slots if s["is_processing"])
        idle = len(slots) - busy
    else:
        idle, busy, missing = await _slot_counts(ingress)
        if missing:
            raise LoadingModel(f"Loading model: {', '.join(missing)} has no replica ready yet")
    body: dict[str, Any] = {"status": "ok", "slots_idle": idle, "slots_processing": busy}
    if detail:
        body["slots"] = slots
    if idle == 0:
        body["status"] = "no slot available"
        if fail_on_no_slot:
            raise NoSlot("no slot available")
    return body


@router.get("/slots")
async def slots(ingress: IngressDep, model: str | None = None) -> list[dict]:
    name = ingress.default_model(model)
    return [slot_json(s) for s in await ingress.call(name, "slots")]


@router.get("/props")
async def props(ingress: IngressDep, request: Request, model: str | None = None) -> dict:
    name = ingress.default_model(model)
    cfg, tokenizer = ingress.model(name), ingress.tokenizers[name]
    replicas = sum(1 for e in await ingress.engines() if e["engine_name"] == name) or 1
    defaults = SamplingParams(max_tokens=ingress.config.max_tokens_default)
    info = await ingress.info(name)
    return {
        "model": name,
        "model_path": cfg.engine.model
        if caller_of(request).operator
        else without_host_detail(cfg.engine.model),
        "total_slots": cfg.engine.max_num_seqs * replicas,  # over the live replicas
        "default_generation_settings": {
            "n_ctx": info.max_model_len,
            "params": defaults.model_dump(mode="json"),
        },
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
        "modalities": {"vision": info.reads_images, "audio": False},
        "media_marker": MEDIA_MARKER,  # where a prompt object's multimodal_data goes
    }


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, ingress: IngressDep) -> dict:
    name = ingress.default_model(req.model)
    ids = await ingress.encode(name, req.content, req.add_special)
    if not req.with_pieces:
        return {"tokens": ids}
    tokenizer = ingress.tokenizers[name]
    return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, ingress: IngressDep) -> dict:
    tokenizer = ingress.tokenizers[ingress.default_model(req.model)]
    bad = next((t for t in req.tokens if not 0 <= t < len(tokenizer)), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary", "tokens")
    return {"content": tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.post("/slots/{id_slot}")
async def slot_action(
    id_slot: int, action: str, ingress: IngressDep, body: SlotFileRequest | None = None
) -> dict:
    body = body or SlotFileRequest()
    if action not in ("save", "restore", "erase"):
        raise InvalidRequestError("action must be save, restore or erase", "action")
    if action != "erase" and not body.filename:
        raise InvalidRequestError(f"{action} needs a filename", "filename")
    name = ingress.default_model(body.model)
    check_slot(ingress, name, id_slot, allow_any=False)
    if action == "erase":
        try:
            n = await ingress.call(name, "free_context", slot_op(id_slot, ContextAction.FREE))
        except ShoalError as exc:
            if exc.status_code != 404:
                raise
            n = 0  # an empty slot: nothing to erase
        return {"id_slot": id_slot, "n_erased": n}
    started = time.perf_counter()
    op = slot_op(id_slot, ContextAction.SAVE if action == "save" else ContextAction.RESTORE)
    try:
        done: ContextFile = await ingress.call(name, f"{action}_context", op, body.filename)
    except ShoalError as exc:
        if exc.status_code == 409 and exc.param is None:  # the slot is busy
            exc.param = "id_slot"
        raise
    counts = (
        {"n_saved": done.num_tokens, "n_written": done.num_bytes}
        if action == "save"
        else {"n_restored": done.num_tokens, "n_read": done.num_bytes}
    )
    timings = {f"{action}_ms": 1000 * (time.perf_counter() - started)}
    return {"id_slot": id_slot, "filename": body.filename, **counts, "timings": timings}


async def _slot_counts(ingress: Ingress) -> tuple[int, int, list[str]]:
    """(idle, processing, models with no live replica), from the replicas' heartbeats:
    no call waits behind a busy model's requests. A model counts as live as
    Ingress.ready_models says, which is what /v1/models lists."""
    engines = await ingress.engines()
    ready = {m.name for m in await ingress.ready_models(engines)}
    idle = busy = 0
    missing = []
    for model in ingress.served_models():
        live = [e for e in engines if e["engine_name"] == model.name and e["runtime_info"]]
        if model.name not in ready and ingress.config.model(model.name) is not None:
            missing.append(model.name)  # a run-time alias's absence is the operator's to report
        for e in live:
            info = e["runtime_info"]
            taken = min(info["num_running"] + info["num_waiting"], model.engine.max_num_seqs)
            busy += taken
            idle += model.engine.max_num_seqs - taken
    return idle, busy, missing


async def _all_slots(ingress: Ingress) -> list[dict]:
    out = []
    for m in ingress.served_models():
        try:
            out += [slot_json(s) for s in await ingress.call(m.name, "slots")]
        except Exception as exc:  # the replica is down or starting
            raise Unavailable(f"model {m.name!r} is not available: {exc}") from None
    return out
