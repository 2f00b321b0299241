"""Parrot's primitives over HTTP: /fill, /generate, /generate_stream, /free_context,
/ping_engine. Contexts live in a model replica's engine (see app.engine.contexts)."""

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter

from app.protocol.messages import ContextOp, Primitive
from app.protocol.parrot import FillRequest, FreeContextRequest, GenerateRequest
from app.protocol.sampling import SamplingParams
from deployments.errors import unwrap
from deployments.generation import Generation, StreamError
from deployments.streaming import GenerationStream

_FILL_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def build_router(get_ingress: Callable[[], Any]) -> APIRouter:
    router = APIRouter()

    @router.post("/fill")
    async def fill(req: FillRequest) -> dict:
        ingress = get_ingress()
        model = ingress.default_model(req.model)
        ids = req.token_ids
        if ids is None:
            ids = await ingress.tokenizer.encode.remote(model, req.text, False)
        op = ContextOp(req.context_key, Primitive.FILL, req.parent_key)
        gen = await _start(ingress, model, ids, _FILL_PARAMS, [], op)
        async for _ in gen.deltas():
            pass
        return {"context_id": req.context_id, "filled_len": len(ids)}

    @router.post("/generate")
    async def generate(req: GenerateRequest) -> dict:
        ingress = get_ingress()
        model = ingress.default_model(req.model)
        gen = await _start_generate(ingress, model, req)
        ids: list[int] = []
        async for _ in _token_ids(gen, ids):
            pass
        out = gen.outputs[0]
        return {
            "context_id": req.context_id,
            "generated_text": out.text,
            "generated_ids": ids,
            "finish_reason": out.finish_reason,
        }

    @router.post("/generate_stream")
    async def generate_stream(req: GenerateRequest) -> GenerationStream:
        ingress = get_ingress()
        model = ingress.default_model(req.model)
        gen = await _start_generate(ingress, model, req)

        async def body() -> AsyncIterator[str]:
            ids: list[int] = []
            try:
                async for delta in _token_ids(gen, ids):
                    event = {"token_ids": delta[0], "text": delta[1], "finish_reason": delta[2]}
                    yield f"data: {json.dumps(event)}\n\n"
            except StreamError as exc:
                yield f"data: {json.dumps({'error': exc.error.message})}\n\n"
            finally:
                gen.cancel()
            yield "data: [DONE]\n\n"

        return GenerationStream(body(), gen, media_type="text/event-stream")

    @router.post("/free_context")
    async def free_context(req: FreeContextRequest) -> dict:
        ingress = get_ingress()
        model = ingress.default_model(req.model)
        try:
            freed = await ingress.model_calls[model].free_context.remote(str(req.context_id))
        except Exception as exc:
            raise unwrap(exc) from None
        return {"context_id": req.context_id, "context_len": freed}

    @router.get("/engines")
    async def engines() -> dict:
        """Registered model replicas and their last runtime info (see EngineRegistry)."""
        ingress = get_ingress()
        if ingress.registry is None:
            return {"engines": []}
        return {"engines": await ingress.registry.list.remote()}

    @router.get("/ping_engine")
    async def ping_engine() -> dict:
        ingress = get_ingress()
        await ingress.refresh_replica_stats()
        return {"pong": True, "models": [m.name for m in ingress.config.models]}

    return router


async def _start_generate(ingress: Any, model: str, req: GenerateRequest) -> Generation:
    cfg = req.sampling_config
    op = ContextOp(req.context_key, Primitive.GENERATE, req.parent_key)
    return await _start(ingress, model, [], cfg.params(), cfg.stop_strings, op)


async def _start(
    ingress: Any, model: str, ids: list[int], params: SamplingParams, stop: list[str], op: ContextOp
) -> Generation:
    prefix: list[int] = []
    if op.primitive is Primitive.GENERATE:
        # The detokenizer starts from the context's tokens, so the first piece reads right.
        prefix = await _context_tokens(ingress, model, op.context_id)
        if prefix is None and op.parent_context_id is not None:
            prefix = await _context_tokens(ingress, model, op.parent_context_id)
    gen = Generation(
        ingress.models[model],
        ingress.tokenizers[model],
        list(ids),
        params,
        stop,
        f"{op.primitive.value}-{uuid.uuid4().hex}",
        context=op,
        detok_prefix=(prefix or []) + list(ids),
    )
    await gen.start_or_raise()
    return gen


async def _context_tokens(ingress: Any, model: str, context_id: str) -> list[int] | None:
    try:
        return await ingress.model_calls[model].context_tokens.remote(context_id)
    except Exception as exc:
        if getattr(unwrap(exc), "status_code", None) == 404:
            return None
        raise unwrap(exc) from None


async def _token_ids(gen: Generation, ids: list[int]) -> AsyncIterator[tuple[list, str, Any]]:
    """Each piece of text with the token ids that made it."""
    async for delta in gen.deltas():
        ids.extend(delta.token_ids)
        yield list(delta.token_ids), delta.text, delta.finish_reason
