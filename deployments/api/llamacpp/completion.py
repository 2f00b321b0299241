"""llama.cpp's generation endpoints: /completion, /infill and /apply-template.

/completion takes llama.cpp's prompt forms (text, token ids, ids mixed with text, or a
list of prompts: one result each, in a list), its two `logit_bias` forms, `n_probs`,
`response_fields` and `return_tokens`, and answers in its shape: `content`, `stop_type`,
`tokens`, `completion_probabilities`, `generation_settings` and `timings`. A request on a
slot (`id_slot`, `cache_prompt`) keeps its tokens and KV in that slot's context. A
prompt object's `multimodal_data` (base64 images) goes where its text's media markers
stand (`<__media__>`, as /props says), for a model that reads images.
"""

import math
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.images import ImageInput
from app.protocol.messages import ContextAction
from app.protocol.outputs import TokenLogprob
from app.protocol.sampling import SamplingParams
from app.text.fim import fim_prompt
from deployments.api.llamacpp.schema import LlamaCompletionRequest, LlamaInfillRequest, PromptPiece
from deployments.api.prompts import MediaPrompt, check_media_count, encode_media_prompt
from deployments.api.slots import check_slot, slot_op
from deployments.http.generation import Generation
from deployments.http.run_all import run_all
from deployments.http.streaming import sse, stream
from deployments.ingress import Ingress, IngressDep, RequestTag

WIRE = sse(lambda exc: {"error": {"message": exc.message}})

router = APIRouter()


@router.post("/completion")
async def completion(req: LlamaCompletionRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    name = ingress.default_model(req.model)
    given = req.prompts()
    check_media_count(given, ingress.config.images.max_images)
    encoded = [await _encode(ingress, name, pieces) for pieces in given]
    prompts = [ids for ids, _ in encoded]
    params = req.params(ingress.config.max_tokens_default, await _bias(ingress, name, req))
    if len(prompts) == 1:
        return await _complete(ingress, name, req, encoded[0], params, tag)
    if req.stream or req.id_slot >= 0:
        raise InvalidRequestError("several prompts are answered unstreamed, on any slot", "prompt")
    if any(not ids for ids in prompts):
        raise InvalidRequestError("prompt must not be empty", "prompt")
    starts = [
        partial(ingress.generate, name, ids, params, req.stop_strings, images=images)
        for ids, images in encoded
    ]
    gens = await run_all(starts, tag)
    return [
        _result(ingress, name, req, gen, ids, 0) for gen, ids in zip(gens, prompts, strict=True)
    ]


@router.post("/infill")
async def infill(req: LlamaInfillRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    name = ingress.default_model(req.model)
    ids = fim_prompt(ingress.tokenizers[name], req.input_prefix, req.input_suffix, req.prompt, name)
    params = req.params(ingress.config.max_tokens_default, await _bias(ingress, name, req))
    return await _complete(ingress, name, req, (ids, ()), params, tag)


async def _encode(
    ingress: Ingress, name: str, pieces: list[PromptPiece | MediaPrompt]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A prompt's ids and images: texts encoded (only the first with the BOS a prompt
    starts with), a prompt object's media markers expanded into its images' tokens, ids
    as they are."""
    ids: list[int] = []
    images: list[ImageInput] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            ids.append(piece)
        elif isinstance(piece, MediaPrompt):
            more, found = await encode_media_prompt(ingress, name, piece, i == 0, len(ids))
            ids += more
            images += found
        elif piece:
            ids += await ingress.encode(name, piece, i == 0)
    return ids, tuple(images)


async def _bias(ingress: Ingress, name: str, req: LlamaCompletionRequest) -> dict[int, float]:
    """logit_bias by token id: a text's bias goes to every token of its encoding."""
    bias: dict[int, float] = {}
    for key, value in req.bias_entries():
        for token_id in [key] if isinstance(key, int) else await ingress.encode(name, key, False):
            bias[token_id] = value
    return bias


async def _slot_context(ingress: Ingress, name: str, id_slot: int, ids: list[int]) -> list[int]:
    """The slot keeps its tokens and KV (a context): a prompt that extends them computes
    only the new part (returned); any other prompt starts the slot afresh."""
    try:
        held = await ingress.call(name, "context_tokens", slot_op(id_slot, ContextAction.READ))
    except ShoalError:
        held = None
    if held and len(held) < len(ids) and ids[: len(held)] == held:
        return ids[len(held) :]
    if held is not None:
        await ingress.call(name, "free_context", slot_op(id_slot, ContextAction.FREE))
    return ids


async def _complete(
    ingress: Ingress,
    name: str,
    req: LlamaCompletionRequest,
    encoded: tuple[list[int], tuple[ImageInput, ...]],
    params: SamplingParams,
    tag: str,
):  # noqa: ANN202
    ids, images = encoded
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    check_slot(ingress, name, req.id_slot, allow_any=True)
    stop = req.stop_strings  # checked before the slot is touched
    context, new_ids = None, ids
    if req.id_slot >= 0 and req.cache_prompt:
        if images:  # a slot's context holds tokens, not images (the prefix cache does)
            raise InvalidRequestError("a prompt with images runs on no slot: id_slot -1", "id_slot")
        new_ids = await _slot_context(ingress, name, req.id_slot, ids)
        context = slot_op(req.id_slot, ContextAction.GENERATE)
    gen = await ingress.generate(name, new_ids, params, stop, tag, context, ids, images=images)
    held = len(ids) - len(new_ids)
    if not req.stream:
        await gen.drain()
        return _result(ingress, name, req, gen, ids, held)

    async def chunks() -> AsyncIterator[dict]:
        if req.return_progress:
            yield {"content": "", "stop": False, "prompt_progress": gen.prompt_progress(held)}
        async for d in gen.deltas():
            if not (d.text or d.token_ids):
                continue
            chunk: dict[str, Any] = {
                "index": 0,
                "content": d.text,
                "tokens": list(d.token_ids),
                "stop": False,
                "id_slot": req.id_slot,
            }
            if req.n_probs:
                chunk["completion_probabilities"] = _probabilities(ingress, name, req, d.logprobs)
            if req.timings_per_token:
                chunk["timings"] = gen.timings()
            yield chunk
        yield {**_result(ingress, name, req, gen, ids, held, streamed=True), "content": ""}

    return stream(gen, chunks(), WIRE)


def _result(
    ingress: Ingress,
    name: str,
    req: LlamaCompletionRequest,
    gen: Generation,
    ids: list[int],
    held: int,
    streamed: bool = False,
) -> dict[str, Any]:
    """The final answer (or a stream's last event) in llama.cpp's shape, cut down to
    `response_fields` when given."""
    out = gen.outputs[0]
    stop_type, word = ("limit" if out.finish_reason == "length" else "eos"), ""
    if out.stops.stopped:
        stop_type, word = "word", out.stops.matched or ""
    result: dict[str, Any] = {
        "index": 0,
        "content": out.text,
        "tokens": out.token_ids if req.return_tokens else [],
        "id_slot": req.id_slot,
        "stop": True,
        "model": name,
        "tokens_predicted": out.num_tokens,
        "tokens_evaluated": len(ids),
        "tokens_cached": held + gen.cached_tokens,
        "generation_settings": _settings(req, gen.params, ingress.tokenizers[name]),
        "prompt": ingress.tokenizers[name].decode(ids, skip_special_tokens=False),
        "has_new_line": "\n" in out.text,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": word,
        "timings": gen.timings(),
    }
    if req.n_probs and not streamed:
        result["completion_probabilities"] = _probabilities(ingress, name, req, out.logprobs)
    if req.response_fields:
        return {f: v for f in req.response_fields if (v := _field(result, f)) is not _MISSING}
    return result


_MISSING = object()


def _field(result: dict[str, Any], path: str) -> Any:
    """`a/b` of a response_fields entry: result["a"]["b"]."""
    value: Any = result
    for key in path.split("/"):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _settings(
    req: LlamaCompletionRequest, params: SamplingParams, tokenizer: Any
) -> dict[str, Any]:
    """generation_settings under llama.cpp's names: what this request runs with. Its
    logit_bias lists {bias, token}, a ban (-inf, and an end-of-generation token under
    ignore_eos) as a null bias, as llama.cpp writes it."""
    bias = [{"bias": b, "token": t} for t, b in params.logit_bias.items()]
    if params.ignore_eos and tokenizer.eos_token_id is not None:
        bias.append({"bias": None, "token": tokenizer.eos_token_id})
    return {
        "n_predict": req.n_predict,
        "max_tokens": params.max_tokens,
        "seed": req.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "n_probs": req.n_probs,
        "post_sampling_probs": req.post_sampling_probs,
        "stop": req.stop,
        "ignore_eos": params.ignore_eos,
        "stream": req.stream,
        "logit_bias": bias,
        "grammar": req.grammar or "",
        "id_slot": req.id_slot,
        "cache_prompt": req.cache_prompt,
    }


def _probabilities(
    ingress: Ingress, name: str, req: LlamaCompletionRequest, lps: list[TokenLogprob]
) -> list[dict[str, Any]]:
    """completion_probabilities: each token with its top alternatives, as logprobs or, with
    post_sampling_probs, as probabilities (of the model's distribution: the engine's
    logprobs are taken before top-k/top-p cut it)."""
    tokenizer = ingress.tokenizers[name]

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        value = {"prob": math.exp(logprob)} if req.post_sampling_probs else {"logprob": logprob}
        return {"id": token_id, "token": text, "bytes": list(text.encode()), **value}

    top = "top_probs" if req.post_sampling_probs else "top_logprobs"
    return [{**entry(lp.token_id, lp.logprob), top: [entry(i, v) for i, v in lp.top]} for lp in lps]
