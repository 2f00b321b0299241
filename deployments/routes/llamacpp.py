"""llama.cpp server endpoints: /health, /slots, /props, /tokenize, /detokenize.

A llama.cpp "slot" is one sequence the server decodes in parallel; here each model
replica has `max_num_seqs` of them (see LLMEngine.slots).
"""

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.messages import ContextOp, Primitive
from app.protocol.sampling import SamplingParams, sampling_params
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.errors import openai_error, unwrap
from deployments.generation import Generation, StreamError
from deployments.model_server import slot_context
from deployments.streaming import GenerationStream


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


class SlotFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: str | None = None
    model: str | None = None


class CompletionRequest(BaseModel):
    """llama.cpp's /completion fields (the ones with a meaning here)."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | list[int] = ""
    n_predict: int = Field(-1, ge=-1)
    temperature: float = 0.8
    top_k: int = Field(40, ge=0)
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    model: str | None = None

    def params(self, default_max_tokens: int) -> SamplingParams:
        fields = dict(
            max_tokens=default_max_tokens if self.n_predict == -1 else max(self.n_predict, 1),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed < 0 else self.seed,
            ignore_eos=self.ignore_eos,
        )
        names = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}
        return sampling_params(fields, names)


class InfillRequest(CompletionRequest):
    input_prefix: str = ""
    input_suffix: str = ""


# Fill-in-the-middle markers: StarCoder/Qwen-coder style, then CodeLlama style.
FIM_TOKENS = [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<PRE>", "<SUF>", "<MID>")]


class Unavailable(ShoalError):
    status_code = 503
    error_type = "unavailable_error"


def build_router(get_ingress: Callable[[], Any]) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(  # noqa: ANN202
        request: Request, include_slots: bool = False, fail_on_no_slot: bool = False
    ):
        """llama.cpp's health: status and slot counts for anyone; each slot's detail (its
        request and sampling settings) only with a key, when keys are set. 503 while a
        model has no live replica."""
        ingress = get_ingress()
        detail = include_slots and request.scope.get("state", {}).get("authenticated", True)
        if detail or ingress.registry is None:
            slots = await _all_slots(ingress)
            idle = sum(1 for s in slots if not s["is_processing"])
            busy = len(slots) - idle
        else:
            idle, busy, missing = await _slot_counts(ingress)
            if missing:
                return openai_error(
                    503,
                    f"Loading model: {', '.join(missing)} has no replica ready yet",
                    error_type="unavailable_error",
                    code="loading_model",
                )
        body: dict[str, Any] = {"status": "ok", "slots_idle": idle, "slots_processing": busy}
        if detail:
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
        info = await ingress.model_calls[name].info.remote()
        return {
            "model": name,
            "model_path": cfg.engine.model,
            "total_slots": cfg.engine.max_num_seqs * cfg.num_replicas,
            "default_generation_settings": {
                "n_ctx": info["max_model_len"],
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

    @router.post("/slots/{id_slot}")
    async def slot_action(id_slot: int, action: str, body: SlotFile | None = None) -> dict:
        if action not in ("save", "restore", "erase"):
            raise InvalidRequestError("action must be save, restore or erase", "action")
        body = body or SlotFile()
        if action != "erase" and not body.filename:
            raise InvalidRequestError(f"{action} needs a filename", "filename")
        ingress = get_ingress()
        name = ingress.default_model(body.model)
        try:
            return await ingress.model_calls[name].slot_action.remote(
                action, id_slot, body.filename
            )
        except Exception as exc:
            raise unwrap(exc) from None

    @router.post("/completion")
    async def completion(req: CompletionRequest):  # noqa: ANN202
        ingress = get_ingress()
        name = ingress.default_model(req.model)
        ids = req.prompt
        if isinstance(ids, str):
            ids = await ingress.tokenizer.encode.remote(name, ids, True) if ids else []
        return await _complete(ingress, name, req, list(ids))

    @router.post("/infill")
    async def infill(req: InfillRequest):  # noqa: ANN202
        ingress = get_ingress()
        name = ingress.default_model(req.model)
        tokenizer = ingress.tokenizers[name]
        ids = fim_prompt(tokenizer, req.input_prefix, req.input_suffix, req.prompt, name)
        return await _complete(ingress, name, req, ids)

    return router


def fim_prompt(
    tokenizer: Any, prefix: str, suffix: str, extra: str | list[int], model: str
) -> list[int]:
    """<prefix marker> prefix <suffix marker> suffix <middle marker> [prompt]."""
    vocab = tokenizer.get_vocab()
    markers = next((m for m in FIM_TOKENS if all(t in vocab for t in m)), None)
    if markers is None:
        raise InvalidRequestError(
            f"model {model!r} has no fill-in-the-middle tokens "
            f"({', '.join(FIM_TOKENS[0])} or {', '.join(FIM_TOKENS[1])}), so /infill "
            "cannot be served for it",
            "model",
        )
    pre, suf, mid = (vocab[t] for t in markers)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []

    tail = enc(extra) if isinstance(extra, str) else list(extra)
    return [pre, *enc(prefix), suf, *enc(suffix), mid, *tail]


async def _complete(ingress: Any, name: str, req: CompletionRequest, ids: list[int]):  # noqa: ANN202
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    slots = ingress.config.model(name).engine.max_num_seqs
    if not -1 <= req.id_slot < slots:
        raise InvalidRequestError(f"id_slot must be -1 (any) or in [0, {slots})", "id_slot")
    params = req.params(ingress.config.max_tokens_default)
    stop = check_stop_strings(req.stop, "stop")
    context, new_ids = None, ids
    if req.id_slot >= 0 and req.cache_prompt:
        # The slot keeps its tokens and KV (a context): a prompt that extends them
        # computes only the new part; any other prompt starts the slot afresh.
        calls, slot = ingress.model_calls[name], slot_context(req.id_slot)
        try:
            held = await calls.context_tokens.remote(slot)
        except Exception:
            held = None
        if held and len(held) < len(ids) and ids[: len(held)] == held:
            new_ids = ids[len(held) :]
        elif held is not None:
            await calls.free_context.remote(slot)
        context = ContextOp(slot, Primitive.GENERATE)
    started = time.perf_counter()
    gen = Generation(
        ingress.models[name],
        ingress.tokenizers[name],
        new_ids,
        params,
        stop,
        f"llamacpp-{uuid.uuid4().hex}",
        context=context,
        detok_prefix=ids,
    )
    await gen.start_or_raise()
    out = gen.outputs[0]

    def final() -> dict:
        elapsed = time.perf_counter() - started
        stop_type = "limit" if out.finish_reason == "length" else "eos"
        word = ""
        if out.stops.stopped:
            stop_type, word = "word", out.stops.matched or ""
        return {
            "content": out.text,
            "id_slot": req.id_slot,
            "stop": True,
            "stop_type": stop_type,
            "stopping_word": word,
            "model": name,
            "tokens_predicted": out.num_tokens,
            "tokens_evaluated": len(ids),
            "tokens_cached": len(ids) - len(new_ids),
            "truncated": False,
            "generation_settings": params.model_dump(mode="json"),
            "timings": {
                "predicted_n": out.num_tokens,
                "predicted_ms": 1000 * elapsed,
                "predicted_per_second": out.num_tokens / elapsed if elapsed else 0.0,
            },
        }

    if not req.stream:
        async for _ in gen.deltas():
            pass
        return final()

    async def body() -> AsyncIterator[str]:
        try:
            async for d in gen.deltas():
                if d.text:
                    yield "data: " + json.dumps({"content": d.text, "stop": False}) + "\n\n"
            yield "data: " + json.dumps({**final(), "content": ""}) + "\n\n"
        except StreamError as exc:
            yield "data: " + json.dumps({"error": {"message": exc.error.message}}) + "\n\n"
        finally:
            gen.cancel()

    return GenerationStream(body(), gen, media_type="text/event-stream")


async def _slot_counts(ingress: Any) -> tuple[int, int, list[str]]:
    """(idle, processing, models with no live replica), from the replicas' heartbeats:
    no call waits behind a busy model's requests."""
    engines = await ingress.registry.list.remote()
    idle = busy = 0
    missing = []
    for model in ingress.config.models:
        live = [e for e in engines if e["engine_name"] == model.name and e["runtime_info"]]
        if not live:
            missing.append(model.name)
        for e in live:
            info = e["runtime_info"]
            taken = min(info["num_running"] + info["num_waiting"], model.engine.max_num_seqs)
            busy += taken
            idle += model.engine.max_num_seqs - taken
    return idle, busy, missing


async def _all_slots(ingress: Any) -> list[dict]:
    out = []
    for name in ingress.models:
        try:
            out += await ingress.model_calls[name].slots.remote()
        except Exception as exc:  # the replica is down or starting
            raise Unavailable(f"model {name!r} is not available: {exc}") from None
    return out
