"""Tokenizer deployment: chat templates and encoding, one tokenizer per served model."""

from collections.abc import Callable
from typing import Any

from ray import serve

from app.models.source import resolve_model
from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.messages import PromptEnding, TemplateArgs
from app.text.tokenizer import chat_prompt, chat_token_ids, load_tokenizer
from deployments.config import ModelDeploymentConfig


class Tokenizer:
    def __init__(self, models: list[ModelDeploymentConfig]) -> None:
        self.tokenizers = {
            m.name: load_tokenizer(resolve_model(m.engine.model), m.chat_template) for m in models
        }
        self.runtime: dict[str, Any] = {}

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
    ) -> list[int]:
        return self._render(chat_token_ids, model, messages, source, tools, ending, args)

    def chat_prompt(
        self,
        model: str,
        messages: list[dict[str, Any]],
        source: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        ending: PromptEnding = "reply",
        args: TemplateArgs | None = None,
    ) -> str:
        """The text `encode_chat` encodes (llama.cpp's /apply-template)."""
        return self._render(chat_prompt, model, messages, source, tools, ending, args)

    def _render(
        self,
        render: Callable[..., Any],
        model: str,
        messages: list[dict[str, Any]],
        source: str | None,
        tools: list[dict[str, Any]] | None,
        ending: PromptEnding,
        args: TemplateArgs | None,
    ) -> Any:
        tokenizer = self._get(model, source)
        own_template = args is not None and args.template is not None
        if not own_template and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {model!r} has no chat template", param="messages")
        if ending == "continue" and (not messages or messages[-1].get("role") != "assistant"):
            raise InvalidRequestError(
                "continuing the final message needs an assistant message last", "messages"
            )
        try:
            return render(tokenizer, messages, tools, ending, args)
        except ShoalError:
            raise
        except Exception as exc:  # template errors (e.g. role order) are the client's
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    def decode(self, model: str, token_ids: list[int]) -> str:
        return self.tokenizers[model].decode(token_ids, skip_special_tokens=True)


TokenizerDeployment = serve.deployment(Tokenizer, name="Tokenizer")
