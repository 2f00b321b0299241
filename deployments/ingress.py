"""Ingress: what every route needs, as one typed object the routes receive.

It holds the handles of the other deployments, the models' tokenizers (for decoding in
this process), the metrics, and the one way to start a generation (`generate`: always
timed and counted). Routes get it as a FastAPI dependency (`IngressDep`) from the app's
state, so a route can run in-process over local deployments (tests) as well as in a
Serve replica (deployments/http/app.py). No model work happens here.
"""

import asyncio
import logging
import time
import uuid
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, Request
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from app.models.source import resolve_model
from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.images import ImageInput
from app.protocol.messages import ContextOp, EngineRequest, PromptEnding, RenderLimits, TemplateArgs
from app.protocol.outputs import EngineInfo
from app.protocol.sampling import SamplingParams
from app.text.light_tokenizer import load_light_tokenizer
from app.text.reasoning import REASONING_FORMATS, ReasoningFormat, template_format
from app.text.request_template import request_templates_refused
from app.text.tokenizer import tools_template
from app.text.tool_calls import ToolFormat, tool_format
from deployments.config import AppConfig, ModelDeploymentConfig
from deployments.http.adapters import LoraAdapters, named_adapter_path, with_named_adapter
from deployments.http.client_scope import current_client
from deployments.http.generation import Generation, overloaded, replica_failure
from deployments.http.guard import Admission
from deployments.http.image_urls import ImageFetcher
from deployments.http.metrics import IngressMetrics, TokenTimer

logger = logging.getLogger("ray.serve")
# Enough of the prompt's end to find a thinking block its template or prefill opened.
PROMPT_TAIL_TOKENS = 256


class UnknownModelError(ShoalError):
    status_code = 404
    error_type = "not_found_error"
    code = "model_not_found"


def unwrap(exc: BaseException) -> BaseException:
    """The replica's own error inside Ray's RayTaskError, when there is one."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class Ingress:
    def __init__(
        self,
        config: AppConfig,
        tokenizer: Any,
        models: dict[str, Any],
        embedder: Any = None,
        registry: Any = None,
        operator: Any = None,
    ) -> None:
        """`tokenizer`, `models` (name -> ModelServer handle), `embedder`, `registry` and
        `operator` are Serve deployment handles (or objects with their call surface)."""
        self.config = config
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.registry = registry
        self.operator = operator
        # Models the operator started at run time (deployments/operator), by alias.
        self.runtime_models: dict[str, ModelDeploymentConfig] = {}
        # Run-time models stopped since: a request naming one is told so (404), never
        # answered by the one model left.
        self.stopped_models: set[str] = set()
        # Closed once the operator drains the app: every new request is refused (503).
        self.admission = Admission()
        self.image_urls = ImageFetcher(config.images)
        # Configured once and cached: per-request .options() is slow.
        self._streams = {name: h.options(stream=True) for name, h in models.items()}
        self._calls = models
        self.tokenizers = {
            m.name: load_light_tokenizer(resolve_model(m.engine.model), m.chat_template)
            for m in config.models
        }
        self._info: dict[str, EngineInfo] = {}
        self.loras = LoraAdapters(config.operator.models_dir)
        self.created = int(time.time())
        self.metrics = IngressMetrics()

    # ---- models -------------------------------------------------------------------
    def find_model(self, name: str) -> ModelDeploymentConfig | None:
        config = self.config.model(name) or self.runtime_models.get(name)
        return config or self.loras.find(self.served_models(), name)

    def served_models(self) -> list[ModelDeploymentConfig]:
        """The configured models, then those started at run time."""
        return [*self.config.models, *self.runtime_models.values()]

    def model(self, name: str) -> ModelDeploymentConfig:
        """A served generative model's config; UnknownModelError (404) otherwise."""
        config = self.find_model(name)
        if config is None:
            raise UnknownModelError(f"The model '{name}' does not exist", param="model")
        return config

    def default_model(self, name: str | None) -> str:
        """The served name of `name` (a name or an alias); the first configured model when
        None or empty."""
        return self.config.models[0].name if not name else self.model(name).name

    def served_name(self, name: str | None) -> str:
        """The model an OpenAI-style request names (a name, an alias, an adapter's). With
        one model served, a missing or null `model` means that one (as llama.cpp and vLLM
        take it), and so does any other name unless `strict_model_names` (not a run-time
        model's since stopped); with several, a missing one is a 400, an unknown one 404."""
        served = self.served_models()
        found = self.find_model(name) if name else None
        if found is not None:
            return found.name
        if name in self.stopped_models:
            raise UnknownModelError(f"The model '{name}' was stopped", param="model")
        if len(served) == 1 and (not name or not self.config.strict_model_names):
            return served[0].name
        if name:
            raise UnknownModelError(f"The model '{name}' does not exist", param="model")
        names = ", ".join(m.name for m in served)
        raise InvalidRequestError(f"model is required: this server serves {names}", "model")

    def embedding_name(self, name: str | None) -> str:
        """The embedding model `name` names; with one served, any name (as for
        `served_name`); 404 otherwise."""
        models = self.embedding_models()
        if not models:
            raise UnknownModelError("this server serves no embedding model", param="model")
        if name in models:
            return name
        if len(models) == 1 and (not name or not self.config.strict_model_names):
            return models[0]
        raise UnknownModelError(f"The model '{name}' does not exist", param="model")

    async def add_model(self, config: ModelDeploymentConfig, handle: Any) -> None:
        """Serve a model started at run time (its tokenizer is loaded first, off the loop)."""
        source = await asyncio.to_thread(resolve_model, config.engine.model)
        self.tokenizers[config.name] = await asyncio.to_thread(
            load_light_tokenizer, source, config.chat_template
        )
        self._calls[config.name] = handle
        self._streams[config.name] = handle.options(stream=True)
        self._info.pop(config.name, None)
        self.runtime_models[config.name] = config
        self.stopped_models.discard(config.name)

    def remove_model(self, name: str) -> None:
        """Stop routing to a run-time model; streams already open keep their handle."""
        if self.runtime_models.pop(name, None) is not None:
            self.stopped_models.add(name)
        self._calls.pop(name, None)
        self._streams.pop(name, None)
        self._info.pop(name, None)

    async def ready_models(self, engines: list[dict] | None = None) -> list[ModelDeploymentConfig]:
        """The served models with a replica ready: registered with the EngineRegistry,
        which a replica does only once its constructor returned (engine loaded, warmed up,
        grammar's vocabulary in): what /v1/models lists and /health waits for. `engines`:
        the registry's list, if the caller has it. No registry (in-process): all served."""
        if self.registry is None:
            return self.served_models()
        if engines is None:
            engines = await self.engines()
        live = {e["engine_name"] for e in engines if e["runtime_info"]}
        return [m for m in self.served_models() if m.name in live]

    def embedding_models(self) -> list[str]:
        return [self.config.embeddings.name] if self.embedder is not None else []

    async def info(self, model: str) -> EngineInfo:
        """What the model's engine reported at start-up (the same for every replica)."""
        if model not in self._info:
            self._info[model] = await self.call(model, "info")
        return self._info[model]

    # ---- calls --------------------------------------------------------------------
    async def generate(
        self,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        tag: str,
        context: ContextOp | None = None,
        detok_prefix: list[int] | None = None,
        reasoning: ReasoningFormat | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> Generation:
        """Start a generation and wait for its first token; a refusal raises (ShoalError).
        `tag` (the HTTP request id) starts the engine's request id, so every hop's logs
        share it; the suffix keeps it unique when a client reuses an id. `reasoning`:
        how the output splits into thinking and answer (see `reasoning`)."""
        params = with_named_adapter(model := self.model(model).name, params)
        rid = f"{tag}.{uuid.uuid4().hex[:8]}"
        path = named_adapter_path(model) if params.lora is not None else None
        request = EngineRequest(rid, list(prompt_ids), params, context, tuple(images), path)
        timer = TokenTimer(self.metrics, model, len(prompt_ids))
        handle = self.loras.handle(model, self._streams[model], params.lora)
        tokenizer = self.tokenizers[model]
        gen = Generation(handle, tokenizer, request, stop, timer, detok_prefix, reasoning)
        await gen.start()
        return gen

    def handle(self, model: str) -> Any:
        """The model's ModelServer handle (for calls that need to name its deployment)."""
        return self._calls[self.model(model).name]

    async def call(self, model: str, method: str, *args: Any) -> Any:
        """A unary call on the model's replicas; the replica's error is raised as itself."""
        name = self.model(model).name
        try:
            return await getattr(self._calls[name], method).remote(*args)
        except BackPressureError as exc:
            raise overloaded(exc) from None
        except RayActorError as exc:  # the replica died under the call: 503, retry
            raise replica_failure(exc) from None
        except Exception as exc:
            raise unwrap(exc) from None

    async def engines(self) -> list[dict]:
        """The live replicas and their last heartbeat (see EngineRegistry); none while
        the registry cannot answer (restarting), rather than failing the caller."""
        if self.registry is None:
            return []
        try:
            return await self.registry.list.remote()
        except Exception as exc:
            logger.warning("engine registry unavailable: %r", exc)
            return []

    async def encode(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        source = self.model(model).engine.model
        return await self.tokenizer.encode.remote(model, text, add_special_tokens, source)

    async def encode_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
    ) -> list[int]:
        """The prompt's ids under the model's chat template (or the request's own, with
        its variables: `args`), ending as `ending` says (app/text/tokenizer.py)."""
        return await self._render("encode_chat", model, messages, tools, ending, args)

    async def encode_chat_with_images(
        self, model: str, messages: list[dict[str, Any]], *rest: Any
    ) -> tuple[list[int], list[ImageInput]]:
        """`encode_chat` of messages that may hold images ({"type": "image"} parts with
        bytes, or a URL fetched here first), and the images at their spans."""
        messages = await self.image_urls.resolve(messages, partial(self.info, model))
        return await self._render("encode_chat_with_images", model, messages, *rest)

    async def chat_prompt(self, model: str, messages: list[dict[str, Any]], *rest: Any) -> str:
        """The text of the prompt `encode_chat` encodes."""
        return await self._render("chat_prompt", model, messages, *rest)

    async def _render(
        self,
        method: str,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
    ) -> Any:
        source = self.model(model).engine.model
        limits = await self._render_limits(model, args)
        try:
            return await getattr(self.tokenizer, method).remote(
                model, messages, source, tools, ending, args, limits
            )
        except Exception as exc:
            raise unwrap(exc) from None

    async def _render_limits(self, model: str, args: TemplateArgs | None) -> RenderLimits | None:
        """For a template the Tokenizer renders in its sandbox (the request's own, or a
        run-time model's), whose render it is and its bound: the model's context. A
        request's own template is refused here (400) unless the config trusts them."""
        own = args is not None and args.template is not None
        if own and not self.config.trust_request_chat_template:
            raise request_templates_refused()
        if not own and model not in self.runtime_models:
            return None  # the operator's template, rendered in the Tokenizer's process
        return RenderLimits(current_client(), (await self.info(model)).max_model_len)

    def tool_format(self, model: str, args: TemplateArgs | None = None) -> ToolFormat | None:
        """The tool-call syntax of the template that renders this model's tools (the
        request's own template, when it brings one); None when no template does (a
        request with tools is then a 400)."""
        template = args.template if args is not None else None
        if template is None:
            template = tools_template(self.tokenizers[model])
        return None if template is None else tool_format(template)

    def reasoning_format(
        self, model: str, args: TemplateArgs | None = None
    ) -> ReasoningFormat | None:
        """The model's reasoning markers (its `reasoning_parser`; auto: as its chat
        template, or the request's own, shows them), or None: it does not reason."""
        parser = self.model(model).reasoning_parser
        if parser == "none":
            return None
        if parser != "auto":
            return REASONING_FORMATS[parser]
        template = args.template if args is not None else None
        if template is None:
            own = getattr(self.tokenizers[model], "chat_template", None)
            template = own if isinstance(own, str | None) else " ".join(own.values())
        return template_format(template)

    def reasoning(
        self, model: str, prompt_ids: list[int], args: TemplateArgs | None = None
    ) -> ReasoningFormat | None:
        """How this request's output splits: the model's markers, starting inside the
        thinking when the prompt's end opened a block (see ReasoningFormat.for_prompt)."""
        fmt = self.reasoning_format(model, args)
        if fmt is None:
            return None
        tail = self.tokenizers[model].decode(prompt_ids[-PROMPT_TAIL_TOKENS:])
        return fmt.for_prompt(tail)


def ingress_of(request: Request) -> Ingress:
    return request.app.state.ingress


def request_tag(request: Request) -> str:
    """The HTTP request's id (Serve's proxy sets X-Request-Id), or a fresh one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


IngressDep = Annotated[Ingress, Depends(ingress_of)]
RequestTag = Annotated[str, Depends(request_tag)]
