"""OpenAI's API: /v1/models, /v1/completions, /v1/embeddings (and the same paths without
/v1), and the pieces every OpenAI response shares; /v1/chat/completions is in
openai_chat.py. Errors: {"error": {message, type, param, code}}."""

import base64
import functools
import hashlib
import importlib.metadata
import struct
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter

from app.protocol.errors import InvalidRequestError
from deployments.api.openai.schema import (
    CompletionRequest,
    EmbeddingRequest,
    sampling_params,
)
from deployments.http.adapters import named_adapter
from deployments.http.errors import error_body
from deployments.http.generation import Generation, OutputState
from deployments.http.run_all import run_all
from deployments.http.streaming import sse, stream
from deployments.ingress import Ingress, IngressDep, RequestTag, unwrap

MAX_PROMPTS = 128  # prompts x n in one /v1/completions request
WIRE = sse(error_body, end="data: [DONE]\n\n")

router = APIRouter()


async def list_models(ingress: IngressDep) -> dict:
    """Every model this server answers for: the generative ones with a replica ready (as
    /health counts them), then the embedding one. `models` lists them again as llama.cpp's
    server does (its web UI and clients read what each can do from `capabilities`)."""
    generative = [m.name for m in await ingress.ready_models()]
    embedding = ingress.embedding_models()
    cards = [_card(ingress, name) for name in generative + embedding]
    cards += [
        _adapter_card(ingress, n, a) for n in generative for a in ingress.loras.of(ingress.model(n))
    ]
    models = [_entry(name, await _capabilities(ingress, name)) for name in generative]
    models += [_entry(name, ["embedding"]) for name in embedding]
    return {"object": "list", "data": cards, "models": models}


async def get_model(model_id: str, ingress: IngressDep) -> dict:
    if model_id in ingress.embedding_models():
        return _card(ingress, model_id)
    name = ingress.model(model_id).name
    adapter = named_adapter(name)
    return _card(ingress, name) if adapter is None else _adapter_card(ingress, name, adapter)


def _card(ingress: Ingress, name: str) -> dict:
    card = {"id": name, "object": "model", "created": ingress.created, "owned_by": "shoal"}
    if name not in ingress.embedding_models() and (aliases := ingress.model(name).aliases):
        card["aliases"] = list(aliases)  # llama.cpp's: other names it answers to
    return card


def _adapter_card(ingress: Ingress, base: str, adapter: str) -> dict:
    """A LoRA adapter, as vLLM lists one: `parent` its base model."""
    card = {"id": f"{base}:{adapter}", "object": "model", "created": ingress.created}
    return {**card, "owned_by": "shoal", "parent": base}


async def _capabilities(ingress: Ingress, name: str) -> list[str]:
    try:
        vision = (await ingress.info(name)).reads_images  # asked once, then kept
    except Exception:  # a replica that cannot answer now does not fail the listing
        vision = False
    # "multimodal" is llama.cpp's word for it (its web UI reads it), "vision" Ollama's.
    return ["completion", *(["vision", "multimodal"] if vision else [])]


def _entry(name: str, capabilities: list[str]) -> dict:
    return {"name": name, "model": name, "capabilities": capabilities}


async def completions(req: CompletionRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    req.model = ingress.served_name(req.model)
    prompts = await _prompts(ingress, req)
    constraint = req.output_constraint()
    params = sampling_params(req, ingress.config.max_tokens_default, req.logprobs, constraint)
    if len(prompts) > 1 and req.stream:
        raise InvalidRequestError("streaming supports one prompt per request", "prompt")
    if req.stream:
        gen = await ingress.generate(req.model, prompts[0], params, req.stop_strings, tag)
        return stream(gen, _completion_chunks(ingress, req, gen), WIRE)
    starts = [
        partial(ingress.generate, req.model, ids, params, req.stop_strings) for ids in prompts
    ]
    gens = await run_all(starts, tag)
    choices = [
        _completion_choice(ingress, req, gen, out, i * req.n + out.index)
        for i, gen in enumerate(gens)
        for out in gen.outputs
    ]
    prompt = sum(len(gen.prompt_ids) for gen in gens)
    completion = sum(gen.completion_tokens for gen in gens)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if len(gens) == 1:
        usage = usage_of(gens[0])
    return {
        **response_head(gens[0], req.model, "cmpl", "text_completion"),
        "choices": choices,
        "usage": usage,
    }


async def embeddings(req: EmbeddingRequest, ingress: IngressDep) -> dict:
    req.model = ingress.embedding_name(req.model)
    inputs = req.inputs()
    if len(inputs) > ingress.config.embeddings.max_batch_inputs:
        raise InvalidRequestError(
            f"at most {ingress.config.embeddings.max_batch_inputs} inputs", "input"
        )
    try:  # an input over the model's length is refused, as OpenAI does (no truncation)
        vectors, tokens = await ingress.embedder.embed.remote(inputs, False)
    except Exception as exc:
        raise unwrap(exc) from None
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


for _prefix in ("/v1", ""):
    router.add_api_route(f"{_prefix}/models", list_models, methods=["GET"])
    router.add_api_route(f"{_prefix}/models/{{model_id:path}}", get_model, methods=["GET"])
    router.add_api_route(f"{_prefix}/completions", completions, methods=["POST"])
    router.add_api_route(f"{_prefix}/embeddings", embeddings, methods=["POST"])


# ---- request and response pieces -----------------------------------------------------------
async def _prompts(ingress: Ingress, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [await ingress.encode(req.model, p)]
    if not p:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if len(p) * req.n > MAX_PROMPTS:
        raise InvalidRequestError(
            f"{len(p)} prompts x n={req.n} outputs: at most {MAX_PROMPTS} in all per request",
            "prompt",
        )
    if all(isinstance(x, str) for x in p):
        return [await ingress.encode(req.model, x) for x in p]
    return [list(x) for x in p]


def response_head(gen: Generation, model: str, prefix: str, kind: str) -> dict:
    return {
        "id": f"{prefix}-{gen.request_id}",
        "object": kind,
        "created": gen.created,
        "model": model,
        "system_fingerprint": fingerprint(model),
    }


@functools.cache
def fingerprint(model: str) -> str:
    """OpenAI's system_fingerprint: names the serving build and the model; it changes
    when either does (so a client can tell why seeded outputs differ)."""
    try:
        build = importlib.metadata.version("shoal")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        build = "source"
    return "fp_" + hashlib.sha256(f"{build}/{model}".encode()).hexdigest()[:10]


def usage_of(gen: Generation) -> dict:
    prompt = len(gen.prompt_ids)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": prompt + gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }
    if any(o.reasoning is not None for o in gen.outputs):  # of completion_tokens
        reasoning = sum(o.reasoning_tokens for o in gen.outputs)
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def token_text(ingress: Ingress, model: str, token_id: int) -> str:
    return ingress.tokenizers[model].decode([token_id])


def _completion_logprobs(ingress: Ingress, model: str, lps: list, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        tok = token_text(ingress, model, lp.token_id)
        tokens.append(tok)
        values.append(lp.logprob)
        tops.append({token_text(ingress, model, i): v for i, v in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _completion_choice(
    ingress: Ingress, req: CompletionRequest, gen: Generation, out: OutputState, index: int
) -> dict:
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


async def _completion_chunks(
    ingress: Ingress, req: CompletionRequest, gen: Generation
) -> AsyncIterator[dict]:
    head = response_head(gen, req.model, "cmpl", "text_completion")
    offsets = [0] * req.n  # text_offset runs on across chunks, as in a non-streamed reply
    if req.echo:
        prompt_text = ingress.tokenizers[req.model].decode(gen.prompt_ids)
        offsets = [len(prompt_text)] * req.n
        for i in range(req.n):
            choice = {"index": i, "text": prompt_text, "finish_reason": None, "logprobs": None}
            yield {**head, "choices": [choice]}
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
        yield {**head, "choices": [choice]}
    if req.stream_options and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": usage_of(gen)}
