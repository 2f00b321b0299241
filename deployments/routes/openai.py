"""OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings."""

import base64
import json
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from app.protocol.errors import InvalidRequestError
from app.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    sampling_params,
)
from deployments.errors import openai_error
from deployments.generation import Generation, StreamError, TextDelta
from deployments.metrics import TokenTimer
from deployments.streaming import GenerationStream

MAX_PROMPTS = 128  # prompts x n in one /v1/completions request, generated together


def build_router(get_ingress: Callable[[], Any]) -> APIRouter:  # noqa: C901
    """Routes resolve the ingress replica at request time (it exists only in the replica)."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict:
        ingress = get_ingress()
        return {
            "object": "list",
            "data": [ingress.model_card(m.name) for m in ingress.config.models],
        }

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):  # noqa: ANN202
        ingress = get_ingress()
        if ingress.config.model(model_id) is None:
            return openai_error(
                404, f"The model '{model_id}' does not exist", "model", "model_not_found"
            )
        return ingress.model_card(model_id)

    async def completions(req: CompletionRequest, request: Request):  # noqa: ANN202
        ingress = get_ingress()
        ingress.require_model(req.model)
        prompts = await _prompts(ingress, req)
        params = sampling_params(req, ingress.config.max_tokens_default, req.logprobs)
        if len(prompts) != 1:
            if req.stream:
                raise InvalidRequestError("streaming supports one prompt per request", "prompt")
            gens = await _run_all(ingress, req, prompts, params, request)
            choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
            for i, (ids, gen) in enumerate(zip(prompts, gens, strict=True)):
                for out in gen.outputs:
                    choices.append(
                        _completion_choice(ingress, req, gen, out, i * req.n + out.index)
                    )
                usage["prompt_tokens"] += len(ids)
                usage["completion_tokens"] += gen.completion_tokens
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return {
                "id": f"cmpl-{gen.request_id}",
                "object": "text_completion",
                "created": gen.created,
                "model": req.model,
                "choices": choices,
                "usage": usage,
            }
        gen = await start_generation(
            ingress, req.model, prompts[0], params, req.stop_strings, request
        )
        if req.stream:
            return _sse(_completion_chunks(ingress, req, gen), gen)
        async for _ in gen.deltas():
            pass
        return {
            "id": f"cmpl-{gen.request_id}",
            "object": "text_completion",
            "created": gen.created,
            "model": req.model,
            "choices": [_completion_choice(ingress, req, gen, o, o.index) for o in gen.outputs],
            "usage": _usage(gen),
        }

    async def chat(req: ChatCompletionRequest, request: Request):  # noqa: ANN202
        ingress = get_ingress()
        ingress.require_model(req.model)
        ids = await ingress.tokenizer.encode_chat.remote(req.model, req.template_messages())
        num_lp = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, ingress.config.max_tokens_default, num_lp)
        gen = await start_generation(ingress, req.model, ids, params, req.stop_strings, request)
        if req.stream:
            return _sse(_chat_chunks(ingress, req, gen), gen)
        async for _ in gen.deltas():
            pass
        choices = []
        for out in gen.outputs:
            choice = {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": None,
            }
            if req.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(ingress, req.model, out.logprobs)}
            choices.append(choice)
        return {
            "id": f"chatcmpl-{gen.request_id}",
            "object": "chat.completion",
            "created": gen.created,
            "model": req.model,
            "choices": choices,
            "usage": _usage(gen),
        }

    async def embeddings(req: EmbeddingRequest):  # noqa: ANN202
        ingress = get_ingress()
        if ingress.embedder is None or req.model != ingress.config.embeddings.name:
            return openai_error(
                404, f"The model '{req.model}' does not exist", "model", "model_not_found"
            )
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or any(not isinstance(t, str) or not t for t in texts):
            raise InvalidRequestError(
                "input must be a non-empty string or list of strings", "input"
            )
        if len(texts) > ingress.config.embeddings.max_batch_inputs:
            raise InvalidRequestError(
                f"at most {ingress.config.embeddings.max_batch_inputs} inputs", "input"
            )
        vectors, tokens = await ingress.embedder.embed.remote(texts)
        data = []
        for i, vec in enumerate(vectors):
            value: Any = vec
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {
            "object": "list",
            "data": data,
            "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    for prefix in ("/v1", ""):
        router.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        router.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        router.add_api_route(f"{prefix}/embeddings", embeddings, methods=["POST"])
    return router


async def _run_all(
    ingress: Any, req: CompletionRequest, prompts: list[list[int]], params, request: Request
) -> list[Generation]:  # noqa: ANN001
    """Several prompts, one after the other (each alone in its share of the batch, as a
    request of its own would be). Not at once: Serve gives every handle call made while
    serving one HTTP request that request's internal id, and its router cannot tell two
    such calls apart while both wait to be routed (one would never be sent)."""
    gens = []
    for i, ids in enumerate(prompts):
        gen = await start_generation(ingress, req.model, ids, params, req.stop_strings, request, i)
        async for _ in gen.deltas():
            pass
        gens.append(gen)
    return gens


async def _prompts(ingress: Any, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [await ingress.tokenizer.encode.remote(req.model, p)]
    if not p:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if not all(isinstance(x, int) for x in p) and len(p) * req.n > MAX_PROMPTS:
        raise InvalidRequestError(
            f"{len(p)} prompts x n={req.n} outputs: at most {MAX_PROMPTS} in all per request",
            "prompt",
        )
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p):
        return [await ingress.tokenizer.encode.remote(req.model, x) for x in p]
    return [list(x) for x in p]


async def start_generation(
    ingress: Any,
    model: str,
    ids: list[int],
    params,
    stop: list[str],
    request: Request,
    part: int = 0,  # noqa: ANN001
) -> Generation:
    # The engine's request id carries the HTTP X-Request-Id so every hop's logs share it;
    # the suffix keeps it unique when a client reuses an id.
    http_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    request_id = f"{http_id}.{part}.{uuid.uuid4().hex[:6]}"
    timer = TokenTimer(ingress.metrics, model)
    gen = Generation(
        ingress.models[model], ingress.tokenizers[model], ids, params, stop, request_id, timer
    )
    ingress.metrics.prompt_tokens.labels(model).inc(len(ids))
    try:
        await gen.start()
    except StreamError as exc:
        e = exc.error
        raise _ApiError(e.status_code, e.message, e.param, e.error_type) from None
    return gen


class _ApiError(InvalidRequestError):
    def __init__(self, status: int, message: str, param: str | None, error_type: str) -> None:
        super().__init__(message, param)
        self.status_code = status
        self.error_type = error_type


def _usage(gen: Generation) -> dict:
    prompt = len(gen.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": prompt + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _token_text(ingress: Any, model: str, token_id: int) -> str:
    return ingress.tokenizers[model].decode([token_id])


def _chat_logprobs(ingress: Any, model: str, lps: list) -> list[dict]:
    out = []
    for lp in lps:
        tok = _token_text(ingress, model, lp.token_id)
        out.append(
            {
                "token": tok,
                "logprob": lp.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(ingress, model, i)),
                        "logprob": v,
                        "bytes": list(t.encode()),
                    }
                    for i, v in lp.top
                ],
            }
        )
    return out


def _completion_logprobs(ingress: Any, model: str, lps: list, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        tok = _token_text(ingress, model, lp.token_id)
        tokens.append(tok)
        values.append(lp.logprob)
        tops.append({_token_text(ingress, model, i): v for i, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _completion_choice(
    ingress: Any, req: CompletionRequest, gen: Generation, out, index: int
) -> dict:  # noqa: ANN001
    prefix = ingress.tokenizers[req.model].decode(gen.prompt_ids) if req.echo else ""
    choice = {
        "index": index,
        "text": prefix + out.text,
        "finish_reason": out.finish_reason,
        "logprobs": None,
    }
    if req.logprobs is not None:
        choice["logprobs"] = _completion_logprobs(ingress, req.model, out.logprobs, len(prefix))
    return choice


def _sse(chunks: AsyncIterator[dict], gen: Generation) -> GenerationStream:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except StreamError as exc:
            err = {
                "error": {
                    "message": exc.error.message,
                    "type": exc.error.error_type,
                    "param": exc.error.param,
                    "code": None,
                }
            }
            yield f"data: {json.dumps(err)}\n\n"
        yield "data: [DONE]\n\n"

    return GenerationStream(
        body(),
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _completion_chunks(
    ingress: Any, req: CompletionRequest, gen: Generation
) -> AsyncIterator[dict]:
    base = {
        "id": f"cmpl-{gen.request_id}",
        "object": "text_completion",
        "created": gen.created,
        "model": req.model,
    }
    offsets = [0] * req.n  # text_offset runs on across chunks, as in a non-streamed reply
    try:
        if req.echo:
            prompt_text = ingress.tokenizers[req.model].decode(gen.prompt_ids)
            offsets = [len(prompt_text)] * req.n
            for i in range(req.n):
                yield {
                    **base,
                    "choices": [
                        {"index": i, "text": prompt_text, "finish_reason": None, "logprobs": None}
                    ],
                }
        async for d in gen.deltas():
            choice = {
                "index": d.index,
                "text": d.text,
                "finish_reason": d.finish_reason,
                "logprobs": None,
            }
            if req.logprobs is not None:
                lps = _completion_logprobs(ingress, req.model, d.logprobs, offsets[d.index])
                choice["logprobs"] = lps
                offsets[d.index] += sum(len(t) for t in lps["tokens"])
            yield {**base, "choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**base, "choices": [], "usage": _usage(gen)}
    finally:
        gen.cancel()


async def _chat_chunks(
    ingress: Any, req: ChatCompletionRequest, gen: Generation
) -> AsyncIterator[dict]:
    base = {
        "id": f"chatcmpl-{gen.request_id}",
        "object": "chat.completion.chunk",
        "created": gen.created,
        "model": req.model,
    }
    try:
        for i in range(req.n):
            yield {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ],
            }
        async for d in gen.deltas():
            yield {**base, "choices": [_chat_delta(ingress, req, d)]}
        if req.stream_options and req.stream_options.include_usage:
            yield {**base, "choices": [], "usage": _usage(gen)}
    finally:
        gen.cancel()


def _chat_delta(ingress: Any, req: ChatCompletionRequest, d: TextDelta) -> dict:
    choice = {
        "index": d.index,
        "delta": {"content": d.text} if d.text else {},
        "finish_reason": d.finish_reason,
        "logprobs": None,
    }
    if req.logprobs and d.logprobs:
        choice["logprobs"] = {"content": _chat_logprobs(ingress, req.model, d.logprobs)}
    return choice
