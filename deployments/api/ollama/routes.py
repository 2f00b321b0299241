"""Ollama's API: /api/generate, /api/chat (NDJSON streams), /api/embed, /api/embeddings,
/api/tags, /api/show, /api/ps, /api/version, and "Ollama is running" at GET/HEAD /.

Errors come back as {"error": "..."} (see deployments.http.errors). Durations are
nanoseconds, as Ollama reports them.
"""

import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from app.protocol.errors import InvalidRequestError, NotFoundError, ShoalError
from app.protocol.messages import TemplateArgs
from app.protocol.sampling import SamplingParams
from app.text.go_template import TemplateError, render
from app.text.reasoning import ReasoningFormat
from app.text.reasoning_grammar import thinking_first
from deployments.api.ollama.local import local_tags
from deployments.api.ollama.replies import respond
from deployments.api.ollama.schema import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaLegacyEmbedRequest,
    OllamaRequest,
    OllamaShowRequest,
    with_images,
)
from deployments.http.caller import caller_of
from deployments.http.chat_turn import ChatTurn, start
from deployments.http.errors import error_shape
from deployments.http.generation import Generation
from deployments.http.host_detail import without_host_detail
from deployments.http.streaming import ndjson
from deployments.ingress import Ingress, IngressDep, RequestTag, unwrap

OLLAMA_VERSION = "0.5.0"  # the API level these routes follow


@error_shape("/api/")
def ollama_error(exc: ShoalError) -> dict:
    return {"error": exc.message}


WIRE = ndjson(ollama_error)

router = APIRouter()


@router.get("/")
@router.head("/")
async def root() -> PlainTextResponse:
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION}


@router.get("/api/tags")
async def tags(ingress: IngressDep) -> dict:
    served = _all_models(ingress)
    on_disk = await local_tags(ingress, served)  # startable by name, not served yet
    return {"models": [_entry(ingress, name) for name in served] + on_disk}


@router.get("/api/ps")
async def ps(ingress: IngressDep) -> dict:
    expires = "2262-04-11T23:47:16Z"  # never unloaded
    return {
        "models": [
            {**_entry(ingress, name), "expires_at": expires} for name in _all_models(ingress)
        ]
    }


@router.post("/api/show")
async def show(req: OllamaShowRequest, ingress: IngressDep, request: Request) -> dict:
    asked = (req.model or req.name or "").removesuffix(":latest")
    if asked in ingress.embedding_models():
        return {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": _entry(ingress, asked)["details"],
            "model_info": {"general.architecture": "bert"},
            "capabilities": ["embedding"],
        }
    if ingress.find_model(asked) is None:  # on disk, not started: what /api/tags says
        on_disk = await local_tags(ingress, _all_models(ingress))
        entry = next((m for m in on_disk if m["name"] in (asked, f"{asked}:latest")), None)
        if entry is not None:
            return {
                "modelfile": f"FROM {asked}",
                "parameters": "",
                "template": "",
                "details": entry["details"],
                "model_info": {},
                "capabilities": ["completion"],
            }
    name = _model_name(ingress, req.model or req.name or "")
    info = await ingress.info(name)
    source = ingress.model(name).engine.model
    if not caller_of(request).operator:
        source = without_host_detail(source)
    return {
        "modelfile": f"FROM {source}",
        "parameters": f"num_ctx {info.max_model_len}",
        "template": getattr(ingress.tokenizers[name], "chat_template", None) or "",
        "details": _entry(ingress, name)["details"],
        "model_info": {"general.architecture": "llama", "context_length": info.max_model_len},
        "capabilities": [
            "completion",
            *(["tools"] if ingress.tool_format(name) else []),
            *(["thinking"] if ingress.reasoning_format(name) else []),
            *(["vision"] if info.reads_images else []),
        ],
    }


@router.post("/api/generate")
async def generate(req: OllamaGenerateRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    started = time.perf_counter()
    name = _model_name(ingress, req.model, "generate")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported by this server")
    args = _think(ingress, name, req)
    images: list = []
    if req.images and (req.raw or req.template or req.context):
        # a context's ids hold earlier images' placeholders without their pixels
        raise InvalidRequestError("images go through the chat template, without raw or context")
    if req.raw or req.template:
        text = req.prompt
        if not req.raw:
            text = _render(req.template, req.system, req.prompt, ingress.config.max_request_bytes)
        ids = await ingress.encode(name, text, False)
    else:
        system = [{"role": "system", "content": req.system}] if req.system else []
        content = with_images(req.prompt, req.images) if req.images else req.prompt
        messages = [*system, {"role": "user", "content": content}]
        ids, images = await ingress.encode_chat_with_images(name, messages, None, "reply", args)
    ids = list(req.context or []) + list(ids)
    reasoning = ingress.reasoning(name, ids, args)
    params = await _params(ingress, name, req, reasoning)
    stops = req.options.stop_strings
    gen = await ingress.generate(
        name, ids, params, stops, tag, reasoning=reasoning, images=tuple(images)
    )

    def piece(text: str, thinking: str = "", calls: list | None = None) -> dict:
        chunk = {"model": req.model, "created_at": _now(), "response": text, "done": False}
        return {**chunk, "thinking": thinking} if thinking else chunk

    def final() -> dict:
        return {**piece(""), **_done(gen, started), "context": ids + gen.outputs[0].token_ids}

    return await respond(gen, req.stream, None, piece, final, WIRE)


@router.post("/api/chat")
async def chat(req: OllamaChatRequest, ingress: IngressDep, tag: RequestTag):  # noqa: ANN201
    started = time.perf_counter()
    name = _model_name(ingress, req.model, "chat")
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    # Ollama has no tool_choice: the model decides, and a call it starts is kept
    # well-formed by the tools' grammar (unless `format` asks for JSON instead).
    await _check_num_ctx(ingress, name, req)
    turn = ChatTurn(
        name,
        [m.template_message() for m in req.messages],
        req.options.sampling(ingress.config.max_tokens_default, None),
        req.constraint(),
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []] or None,
        template_args=_think(ingress, name, req),
        stop_strings=req.options.stop_strings,
    )
    gen, prepared = await start(ingress, turn, tag)
    fmt = prepared.tool_format

    def piece(text: str, thinking: str = "", calls: list | None = None) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"model": req.model, "created_at": _now(), "message": message, "done": False}

    final = lambda: {**piece(""), **_done(gen, started)}  # noqa: E731
    return await respond(gen, req.stream, fmt, piece, final, WIRE)


@router.post("/api/embed")
async def embed(req: OllamaEmbedRequest, ingress: IngressDep) -> dict:
    started = time.perf_counter()
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    vectors, tokens = await _embed(ingress, req.model, texts, req.truncate)
    return {
        "model": req.model,
        "embeddings": vectors,
        "total_duration": _ns(time.perf_counter() - started),
        "load_duration": 0,  # the model is always loaded
        "prompt_eval_count": tokens,
    }


@router.post("/api/embeddings")
async def embeddings(req: OllamaLegacyEmbedRequest, ingress: IngressDep) -> dict:
    vectors, _ = await _embed(ingress, req.model, [req.prompt])
    return {"embedding": vectors[0]}


# ---- helpers -----------------------------------------------------------------------------
def _model_name(ingress: Ingress, name: str, action: str = "generate") -> str:
    """Ollama names carry a tag; ':latest' is the one every served model has. The
    embedding model is listed too, but only embeds."""
    base = name.removesuffix(":latest")
    if base in ingress.embedding_models():
        raise InvalidRequestError(f'"{name}" does not support {action}', param="model")
    found = ingress.find_model(base)
    if found is None:
        raise NotFoundError(f"model '{name}' not found", param="model")
    return base if base in (found.name, *found.aliases) else found.name  # an adapter's base


def _all_models(ingress: Ingress) -> list[str]:
    return [m.name for m in ingress.served_models()] + ingress.embedding_models()


def _entry(ingress: Ingress, name: str) -> dict:
    cfg = ingress.find_model(name)
    if cfg is None:  # the embedding model
        family, fmt, level = "bert", "safetensors", "F32"
    else:
        family = "llama"
        fmt = "gguf" if cfg.engine.model == "default" else "safetensors"
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


def _think(ingress: Ingress, name: str, req: OllamaRequest) -> TemplateArgs | None:
    """`think` for the template (enable_thinking); asking a model that does not reason
    to think is refused, as Ollama does."""
    if req.think not in (None, False) and ingress.reasoning_format(name) is None:
        raise InvalidRequestError(f'"{req.model}" does not support thinking', "think")
    return req.template_args()


async def _params(
    ingress: Ingress, name: str, req: OllamaRequest, reasoning: ReasoningFormat | None
) -> SamplingParams:
    """/api/generate's: `format` applies to the answer, after any thinking."""
    await _check_num_ctx(ingress, name, req)
    constraint = req.constraint()
    if constraint is not None and reasoning is not None:
        constraint = thinking_first(reasoning, constraint)
    return req.options.sampling(ingress.config.max_tokens_default, constraint)


async def _check_num_ctx(ingress: Ingress, name: str, req: OllamaRequest) -> None:
    num_ctx = req.options.num_ctx
    if num_ctx is not None:
        limit = (await ingress.info(name)).max_model_len
        if num_ctx > limit:
            raise InvalidRequestError(
                f"num_ctx {num_ctx} is more than the model's context length {limit}",
                "options.num_ctx",
            )


def _render(template: str | None, system: str | None, prompt: str, max_chars: int) -> str:
    """An Ollama template ({{ .System }}, {{ .Prompt }}, if/else/end); user text is only
    ever inserted, never read as template or as a regex replacement, and the result is
    no larger than a request may be."""
    values = {"System": system or "", "Prompt": prompt}
    try:
        return render(template or "{{ .Prompt }}", values, max_chars)
    except TemplateError as exc:
        raise InvalidRequestError(f"template: {exc}", "template") from None


def _done(gen: Generation, started: float) -> dict:
    """The last object's figures: `started` is when the request came in; prompt eval runs
    until the first token."""
    out = gen.outputs[0]
    now = time.perf_counter()
    prompt_s = max((gen.first_token_at or now) - started, 0.0)
    return {
        "done": True,
        "done_reason": "length" if out.finish_reason == "length" else "stop",
        "total_duration": _ns(now - started),
        "load_duration": 0,  # the model is always loaded
        "prompt_eval_count": len(gen.prompt_ids),
        "prompt_eval_duration": _ns(prompt_s),
        "eval_count": out.num_tokens,
        "eval_duration": _ns(max(now - started - prompt_s, 0.0)),
    }


async def _embed(
    ingress: Ingress, model: str, texts: list[str], truncate: bool = True
) -> tuple[list, int]:
    name = model.removesuffix(":latest")
    if name not in ingress.embedding_models():
        if ingress.find_model(name) is not None:
            served = ", ".join(ingress.embedding_models()) or "none"
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
    try:
        return await ingress.embedder.embed.remote(texts, truncate)
    except Exception as exc:
        raise unwrap(exc) from None


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
