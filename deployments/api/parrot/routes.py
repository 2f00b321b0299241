"""Parrot's primitives over HTTP: /fill, /generate, /generate_stream, /free_context,
/ping_engine, /engines. Contexts live in a model replica's engine (see
app.engine.contexts); every call names its context with a ContextOp, which the router
reads to reach the replica that holds it."""

from collections.abc import AsyncIterator

from fastapi import APIRouter

from app.protocol.errors import ShoalError
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.sampling import SamplingParams
from deployments.api.parrot.schema import FillRequest, FreeContextRequest, ParrotGenerateRequest
from deployments.http.generation import Generation
from deployments.http.streaming import sse, stream
from deployments.ingress import Ingress, IngressDep, RequestTag

# A fill computes its tokens' KV; the engine samples one token nobody sees.
FILL_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
WIRE = sse(lambda exc: {"error": exc.message}, end="data: [DONE]\n\n")

router = APIRouter()


@router.post("/fill")
async def fill(req: FillRequest, ingress: IngressDep, tag: RequestTag) -> dict:
    model = ingress.default_model(req.model)
    ids = req.token_ids
    if ids is None:
        ids = await ingress.encode(model, req.text, False)
    op = ContextOp(req.context_key, ContextAction.FILL, req.parent_key)
    gen = await ingress.generate(model, ids, FILL_PARAMS, [], tag, op)
    await gen.drain()
    return {"context_id": req.context_id, "filled_len": len(ids)}


@router.post("/generate")
async def generate(req: ParrotGenerateRequest, ingress: IngressDep, tag: RequestTag) -> dict:
    gen = await _start_generate(ingress, req, tag)
    await gen.drain()
    out = gen.outputs[0]
    return {
        "context_id": req.context_id,
        "generated_text": out.text,
        "generated_ids": out.token_ids,
        "finish_reason": out.finish_reason,
    }


@router.post("/generate_stream")
async def generate_stream(req: ParrotGenerateRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    gen = await _start_generate(ingress, req, tag)

    async def events() -> AsyncIterator[dict]:
        async for d in gen.deltas():
            yield {"token_ids": list(d.token_ids), "text": d.text, "finish_reason": d.finish_reason}

    return stream(gen, events(), WIRE)


@router.post("/free_context")
async def free_context(req: FreeContextRequest, ingress: IngressDep) -> dict:
    model = ingress.default_model(req.model)
    op = ContextOp(str(req.context_id), ContextAction.FREE)
    freed = await ingress.call(model, "free_context", op)
    return {"context_id": req.context_id, "context_len": freed}


@router.get("/engines")
async def engines(ingress: IngressDep) -> dict:
    """Registered model replicas and their last runtime info (see EngineRegistry)."""
    return {"engines": await ingress.engines()}


@router.get("/ping_engine")
async def ping_engine(ingress: IngressDep) -> dict:
    """Pong, with the models that have a replica answering now."""
    answering = []
    for m in ingress.served_models():
        try:
            await ingress.call(m.name, "info")  # a round trip to one of its replicas
            answering.append(m.name)
        except Exception:  # a replica restarting or full: pong all the same
            continue
    return {"pong": True, "models": answering}


async def _start_generate(ingress: Ingress, req: ParrotGenerateRequest, tag: str) -> Generation:
    model = ingress.default_model(req.model)
    cfg = req.sampling_config
    op = ContextOp(req.context_key, ContextAction.GENERATE, req.parent_key)
    # The detokenizer starts from the context's tokens, so the first piece reads right.
    prefix = await _context_tokens(ingress, model, op.context_id)
    if prefix is None and op.parent_context_id is not None:
        prefix = await _context_tokens(ingress, model, op.parent_context_id)
    return await ingress.generate(
        model, [], cfg.params(), cfg.stop_strings, tag, op, detok_prefix=prefix or []
    )


async def _context_tokens(ingress: Ingress, model: str, context_id: str) -> list[int] | None:
    try:
        return await ingress.call(
            model, "context_tokens", ContextOp(context_id, ContextAction.READ)
        )
    except ShoalError as exc:
        if exc.status_code == 404:  # not there (yet): a 410 says it was dropped, and is raised
            return None
        raise
