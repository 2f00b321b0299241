"""Tokenizer deployment: chat templates and encoding, one tokenizer per served model.

The configured models' templates (the operator's) render in this process. The others
render in its sandbox (app/text/request_template.py: a few worker processes, bounded in
time, memory and output, with a fair, bounded waiting line): a request's own template
(only with `trust_request_chat_template`; else a 400) and the template of a model the
operator started at run time from a downloaded repo."""

from collections.abc import Callable
from typing import Any

from ray import serve

from app.models.source import resolve_model
from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.images import ImageInput
from app.protocol.messages import PromptEnding, RenderLimits, TemplateArgs
from app.text.images import encode_with_images, load_processor, take_images
from app.text.render_pool import RenderPool, Sandbox
from app.text.request_template import request_templates_refused
from app.text.tokenizer import chat_prompt, chat_token_ids, load_tokenizer
from deployments.config import ModelDeploymentConfig, TemplateSandboxConfig
from deployments.images_config import ImagesConfig


class Tokenizer:
    def __init__(
        self,
        models: list[ModelDeploymentConfig],
        trust_request_chat_template: bool = False,
        sandbox: TemplateSandboxConfig | None = None,
        images: ImagesConfig | None = None,
    ) -> None:
        self.models = models
        self.tokenizers = {
            m.name: load_tokenizer(resolve_model(m.engine.model), m.chat_template) for m in models
        }
        self.runtime: dict[str, Any] = {}
        self.processors: dict[str, Any] = {}  # image processors, on a model's first image
        self.image_limits = (images or ImagesConfig()).limits()
        self.trust_request_chat_template = trust_request_chat_template
        sandbox = sandbox or TemplateSandboxConfig()
        self.pool = RenderPool(  # its workers start on first use
            sandbox.workers, sandbox.max_queued, sandbox.max_queued_per_client, sandbox.timeout_s
        )

    def _get(self, model: str, source: str | None) -> Any:
        """A configured model's tokenizer, or, for a model started at run time, the one
        at `source` (loaded on first use)."""
        if model in self.tokenizers:
            return self.tokenizers[model]
        if source is None:
            raise InvalidRequestError(f"unknown model {model!r}", param="model")
        # By source too: an alias stopped and started again may name other weights.
        key = f"{model}@{source}"
        if key not in self.runtime:
            self.runtime[key] = load_tokenizer(resolve_model(source))
        return self.runtime[key]

    def encode(
        self, model: str, text: str, add_special_tokens: bool = True, source: str | None = None
    ) -> list[int]:
        tokenizer = self._get(model, source)
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        source: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
        limits: RenderLimits | None = None,
    ) -> list[int]:
        """`limits`: whose render it is and its prompt's bound, for a template rendered
        in the sandbox (the ingress sends them then)."""
        return self._render(chat_token_ids, model, messages, source, tools, ending, args, limits)

    def encode_chat_with_images(
        self,
        model: str,
        messages: list[dict[str, Any]],
        source: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
        limits: RenderLimits | None = None,
    ) -> tuple[list[int], list[ImageInput]]:
        """`encode_chat` of messages that may hold images ({"type": "image", "image":
        bytes} parts): the ids with each image's placeholder expanded by the model's
        processor, and the images at their spans (app/text/images.py)."""
        messages, images = take_images(messages)
        if not images:
            return self.encode_chat(model, messages, source, tools, ending, args, limits), []
        processor = self._processor(model, source)
        text = self._render(chat_prompt, model, messages, source, tools, ending, args, limits)
        return encode_with_images(processor, text, images, self.image_limits)

    def encode_with_images(
        self,
        model: str,
        text: str,
        images: list[bytes],
        marker: str,
        add_special_tokens: bool = True,
        source: str | None = None,
    ) -> tuple[list[int], list[ImageInput]]:
        """A raw prompt's ids with each `marker` expanded by the model's processor into
        the next image's tokens, and the images at their spans (llama.cpp's prompt
        objects with `multimodal_data`)."""
        processor = self._processor(model, source)
        return encode_with_images(
            processor, text, images, self.image_limits, marker, add_special_tokens
        )

    def _processor(self, model: str, source: str | None) -> Any:
        key = model if model in self.tokenizers else f"{model}@{source}"
        if key not in self.processors:
            config = next((m for m in self.models if m.name == model), None)
            path = config.engine.model if config is not None else source
            mmproj = config.engine.mmproj if config is not None else None
            tokenizer, limits = self._get(model, source), self.image_limits
            found = load_processor(resolve_model(path), mmproj, tokenizer, limits) if path else None
            self.processors[key] = found
        if self.processors[key] is None:
            raise InvalidRequestError(
                f"image input is not supported: model {model!r} does not read images; "
                "send text only",
                "messages",
            )
        return self.processors[key]

    def chat_prompt(
        self,
        model: str,
        messages: list[dict[str, Any]],
        source: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
        limits: RenderLimits | None = None,
    ) -> str:
        """The text `encode_chat` encodes (llama.cpp's /apply-template); an image is its
        template's placeholder."""
        messages, _ = take_images(messages)
        return self._render(chat_prompt, model, messages, source, tools, ending, args, limits)

    def _render(
        self,
        render: Callable[..., Any],
        model: str,
        messages: list[dict[str, Any]],
        source: str | None,
        tools: list[dict[str, Any]] | None,
        ending: PromptEnding,
        args: TemplateArgs | None,
        limits: RenderLimits | None,
    ) -> Any:
        own_template = args is not None and args.template is not None
        if own_template and not self.trust_request_chat_template:
            raise request_templates_refused()
        tokenizer = self._get(model, source)
        if not own_template and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {model!r} has no chat template", param="messages")
        if ending == "continue" and (not messages or messages[-1].get("role") != "assistant"):
            raise InvalidRequestError(
                "continuing the final message needs an assistant message last", "messages"
            )
        # A downloaded model's template is not the operator's: it renders apart too.
        downloaded = model not in self.tokenizers
        sandbox = Sandbox(self.pool, limits or RenderLimits(), model_template=downloaded)
        try:
            return render(tokenizer, messages, tools, ending, args, sandbox)
        except ShoalError:
            raise
        except Exception as exc:  # template errors (e.g. role order) are the client's
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    def decode(self, model: str, token_ids: list[int]) -> str:
        return self.tokenizers[model].decode(token_ids, skip_special_tokens=True)


TokenizerDeployment = serve.deployment(Tokenizer, name="Tokenizer")
