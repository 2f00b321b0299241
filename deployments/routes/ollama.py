"""Ollama's API: /api/generate, /api/chat (NDJSON streams), /api/embed, /api/embeddings,
/api/tags, /api/show, /api/ps, /api/version, and "Ollama is running" at GET/HEAD /.

Errors come back as {"error": "..."} (see deployments.errors.is_ollama). Durations are
nanoseconds, as Ollama reports them.
"""

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError, NotFoundError
from app.protocol.sampling import MAX_SEED, SamplingParams, sampling_params
from app.text.go_template import MAX_TEMPLATE_BYTES, TemplateError, render
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.generation import Generation, StreamError
from deployments.routes.openai import start_generation
from deployments.streaming import GenerationStream

OLLAMA_VERSION = "0.5.0"  # the API level these routes follow


class Options(BaseModel):
    """Ollama's runtime options that mean something here; others are accepted and ignored
    (Ollama does the same with options a runner does not use)."""

    model_config = ConfigDict(extra="ignore")
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] | str | None = Field(None, max_length=MAX_STOP_STRINGS)
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = Field(None, ge=1)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = True
    format: str | dict | None = None
    options: Options = Field(default_factory=Options)
    keep_alive: str | int | float | None = None

    think: bool | str | None = None  # reasoning output: not served yet


class GenerateRequest(_Common):
    prompt: str = ""
    system: str | None = None
    template: str | None = Field(None, max_length=MAX_TEMPLATE_BYTES)
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None  # not served: refused when given
    suffix: str | None = None  # not served: refused when given


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # not served: refused when given
    tool_calls: list[dict[str, Any]] | None = None  # not served: refused when given


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # not served: refused when given


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str]


class LegacyEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None  # older clients


def build_router(get_ingress: Callable[[], Any]) -> APIRouter:
    router = APIRouter()

    @router.get("/")
    @router.head("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    @router.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @router.get("/api/tags")
    async def tags() -> dict:
        ingress = get_ingress()
        names = [m.name for m in ingress.config.models] + _embedding_models(ingress)
        return {"models": [_model_entry(ingress, name) for name in names]}

    @router.get("/api/ps")
    async def ps() -> dict:
        ingress = get_ingress()
        names = [m.name for m in ingress.config.models] + _embedding_models(ingress)
        return {
            "models": [
                {**_model_entry(ingress, name), "expires_at": "2262-04-11T23:47:16Z"}
                for name in names
            ]
        }

    @router.post("/api/show")
    async def show(req: ShowRequest) -> dict:
        ingress = get_ingress()
        asked = req.model or req.name or ""
        if asked.removesuffix(":latest") in _embedding_models(ingress):
            entry = _model_entry(ingress, asked.removesuffix(":latest"))
            return {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": {"general.architecture": "bert"},
                "capabilities": ["embedding"],
            }
        name = _model_name(ingress, asked)
        cfg = ingress.config.model(name)
        info = await ingress.model_calls[name].info.remote()
        tokenizer = ingress.tokenizers[name]
        return {
            "modelfile": f"FROM {cfg.engine.model}",
            "parameters": f"num_ctx {info['max_model_len']}",
            "template": getattr(tokenizer, "chat_template", None) or "",
            "details": _model_entry(ingress, name)["details"],
            "model_info": {
                "general.architecture": "llama",
                "context_length": info["max_model_len"],
            },
        }

    @router.post("/api/generate")
    async def generate(req: GenerateRequest, request: Request):  # noqa: ANN202
        ingress = get_ingress()
        name = _model_name(ingress, req.model, "generate")
        if req.images or req.suffix:
            raise InvalidRequestError("images and suffix are not supported by this server")
        params, stop = await _params(ingress, name, req)
        started = time.perf_counter()
        if req.raw or req.template:
            text = req.prompt
            if not req.raw:
                limit = ingress.config.max_request_bytes
                text = _render(req.template, req.system, req.prompt, limit)
            ids = await ingress.tokenizer.encode.remote(name, text, False)
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}
            ]
            ids = await ingress.tokenizer.encode_chat.remote(name, messages)
        ids = list(req.context or []) + list(ids)
        gen = await start_generation(ingress, name, ids, params, stop, request)

        def piece(text: str) -> dict:
            return {"model": req.model, "created_at": _now(), "response": text, "done": False}

        def final(out_ids: list[int]) -> dict:
            return {
                **piece(""),
                **_done(gen, ids, started),
                "context": ids + out_ids,
            }

        return await _respond(gen, req.stream, piece, final, lambda t: {"response": t})

    @router.post("/api/chat")
    async def chat(req: ChatRequest, request: Request):  # noqa: ANN202
        ingress = get_ingress()
        name = _model_name(ingress, req.model, "chat")
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if req.tools or any(m.images or m.tool_calls for m in req.messages):
            raise InvalidRequestError(
                "tools, tool calls and images are not supported by this server", "tools"
            )
        params, stop = await _params(ingress, name, req)
        started = time.perf_counter()
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = await ingress.tokenizer.encode_chat.remote(name, messages)
        gen = await start_generation(ingress, name, ids, params, stop, request)

        def piece(text: str) -> dict:
            return {
                "model": req.model,
                "created_at": _now(),
                "message": {"role": "assistant", "content": text},
                "done": False,
            }

        def final(out_ids: list[int]) -> dict:
            return {**piece(""), **_done(gen, ids, started)}

        return await _respond(
            gen,
            req.stream,
            piece,
            final,
            lambda t: {"message": {"role": "assistant", "content": t}},
        )

    @router.post("/api/embed")
    async def embed(req: EmbedRequest) -> dict:
        ingress = get_ingress()
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        started = time.perf_counter()
        vectors, tokens = await _embed(ingress, req.model, texts)
        elapsed = _ns(time.perf_counter() - started)
        return {
            "model": req.model,
            "embeddings": vectors,
            "total_duration": elapsed,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }

    @router.post("/api/embeddings")
    async def embeddings(req: LegacyEmbedRequest) -> dict:
        vectors, _ = await _embed(get_ingress(), req.model, [req.prompt])
        return {"embedding": vectors[0]}

    return router


# ---- helpers -----------------------------------------------------------------------------
def _model_name(ingress: Any, name: str, action: str = "generate") -> str:
    """Ollama names carry a tag; ':latest' is the one every served model has. The
    embedding model is listed too, but only embeds."""
    base = name.removesuffix(":latest")
    if base in _embedding_models(ingress):
        raise InvalidRequestError(f'"{name}" does not support {action}', param="model")
    if ingress.config.model(base) is None:
        raise NotFoundError(f"model '{name}' not found", param="model")
    return base


def _embedding_models(ingress: Any) -> list[str]:
    return [ingress.config.embeddings.name] if ingress.embedder is not None else []


def _model_entry(ingress: Any, name: str) -> dict:
    cfg = ingress.config.model(name)
    if cfg is None:  # the embedding model
        family, fmt, level = "bert", "safetensors", "F32"
    else:
        family = "llama"
        fmt = "gguf" if cfg.engine.model in ("default",) else "safetensors"
        level = str(cfg.engine.dtype)
    return {
        "name": f"{name}:latest",
        "model": f"{name}:latest",
        "modified_at": datetime.fromtimestamp(ingress.created, UTC).isoformat(),
        "size": 0,
        "digest": "",
        "details": {
            "format": fmt,
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": level,
        },
    }


async def _params(ingress: Any, name: str, req: _Common) -> tuple[SamplingParams, list[str]]:
    if req.think:
        raise InvalidRequestError(
            "think (reasoning output) is not supported by this server", "think"
        )
    if req.format is not None:
        raise InvalidRequestError(
            "format (JSON-constrained output) is not supported yet: Shoal cannot guarantee "
            "valid JSON, so it refuses rather than return text that may not parse",
            "format",
        )
    o = req.options
    if o.num_ctx is not None:
        info = await ingress.model_calls[name].info.remote()
        if o.num_ctx > info["max_model_len"]:
            raise InvalidRequestError(
                f"num_ctx {o.num_ctx} is more than the model's context length "
                f"{info['max_model_len']}",
                "options.num_ctx",
            )
    fields: dict[str, Any] = {
        "max_tokens": ingress.config.max_tokens_default
        if o.num_predict is None or o.num_predict < 0
        else max(o.num_predict, 1),
        "temperature": 0.8 if o.temperature is None else o.temperature,
        "top_k": 40 if o.top_k is None else o.top_k,
        "top_p": 0.9 if o.top_p is None else o.top_p,
        "min_p": 0.0 if o.min_p is None else o.min_p,
        "seed": o.seed,
        "repetition_penalty": 1.1 if o.repeat_penalty is None else o.repeat_penalty,
        "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0,
    }
    names = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
    params = sampling_params(fields, names, prefix="options.")
    stop = check_stop_strings(
        [o.stop] if isinstance(o.stop, str) else list(o.stop or []), "options.stop"
    )
    return params, stop


def _render(template: str | None, system: str | None, prompt: str, max_chars: int) -> str:
    """An Ollama template ({{ .System }}, {{ .Prompt }}, if/else/end); user text is only
    ever inserted, never read as template or as a regex replacement, and the result is
    no larger than a request may be."""
    values = {"System": system or "", "Prompt": prompt}
    try:
        return render(template or "{{ .Prompt }}", values, max_chars)
    except TemplateError as exc:
        raise InvalidRequestError(f"template: {exc}", "template") from None


def _done(gen: Generation, prompt_ids: list[int], started: float) -> dict:
    out = gen.outputs[0]
    total = time.perf_counter() - started
    first = gen.first_token_at or time.perf_counter()
    prompt_s = max(first - started, 0.0)
    return {
        "done": True,
        "done_reason": "length" if out.finish_reason == "length" else "stop",
        "total_duration": _ns(total),
        "load_duration": 0,
        "prompt_eval_count": len(prompt_ids),
        "prompt_eval_duration": _ns(prompt_s),
        "eval_count": out.num_tokens,
        "eval_duration": _ns(max(total - prompt_s, 0.0)),
    }


async def _respond(gen: Generation, stream: bool, piece, final, whole):  # noqa: ANN001, ANN202
    out_ids: list[int] = []
    if not stream:
        async for d in gen.deltas():
            out_ids.extend(d.token_ids)
        done = final(out_ids)
        done.update(whole(gen.outputs[0].text))
        return done

    async def body() -> AsyncIterator[str]:
        try:
            async for d in gen.deltas():
                out_ids.extend(d.token_ids)
                if d.text:
                    yield json.dumps(piece(d.text)) + "\n"
            yield json.dumps(final(out_ids)) + "\n"
        except StreamError as exc:
            yield json.dumps({"error": exc.error.message}) + "\n"
        finally:
            gen.cancel()

    return GenerationStream(body(), gen, media_type="application/x-ndjson")


async def _embed(ingress: Any, model: str, texts: list[str]) -> tuple[list, int]:
    name = model.removesuffix(":latest")
    if name not in _embedding_models(ingress):
        if ingress.config.model(name) is not None:
            served = ", ".join(_embedding_models(ingress)) or "none"
            raise InvalidRequestError(
                f"model '{model}' generates text and cannot embed; embedding models: {served}",
                param="model",
            )
        raise NotFoundError(f"model '{model}' not found", param="model")
    if not texts or any(not t for t in texts):
        raise InvalidRequestError("input must be a non-empty string or list of strings")
    limit = ingress.config.embeddings.max_batch_inputs
    if len(texts) > limit:
        raise InvalidRequestError(f"input has {len(texts)} texts; at most {limit}", "input")
    return await ingress.embedder.embed.remote(texts)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
