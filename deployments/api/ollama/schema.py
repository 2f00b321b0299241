"""Ollama's request schemas and their mapping onto neutral SamplingParams.

Lenient where Ollama is (unknown fields and runtime options are ignored), strict on what
we cannot honour: `suffix` is refused by the routes rather than silently
ignored. `think` reaches the chat template as `enable_thinking`. `format` ("json" or a JSON schema) constrains the output; `tools` are
OpenAI-shaped, and calls come back in `message.tool_calls` with arguments as objects.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import TemplateArgs
from app.protocol.sampling import (
    MAX_CONSTRAINT_CHARS,
    MAX_SEED,
    Constraint,
    SamplingParams,
    sampling_params,
)
from app.text.go_template import MAX_TEMPLATE_BYTES
from app.text.images import base64_bytes
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.api.structured import ToolDef

THINK_LEVELS = ("low", "medium", "high")


class OllamaOptions(BaseModel):
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

    def sampling(
        self, default_max_tokens: int, constraint: Constraint | None = None
    ) -> SamplingParams:
        """Ollama's defaults where an option is not given (temperature 0.8, top_k 40, ...)."""
        fields: dict[str, Any] = {
            "max_tokens": default_max_tokens
            if self.num_predict is None or self.num_predict < 0
            else max(self.num_predict, 1),
            "temperature": 0.8 if self.temperature is None else self.temperature,
            "top_k": 40 if self.top_k is None else self.top_k,
            "top_p": 0.9 if self.top_p is None else self.top_p,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "repetition_penalty": 1.1 if self.repeat_penalty is None else self.repeat_penalty,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "constraint": constraint,
        }
        names = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
        return sampling_params(fields, names, prefix="options.")

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return check_stop_strings(stops, "options.stop")


class OllamaRequest(BaseModel):
    """What /api/generate and /api/chat share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    stream: bool = True
    format: str | dict | None = None  # "json", or a JSON schema the output must match
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: str | int | float | None = None
    think: bool | str | None = None  # None: as the model's template does by default

    def template_args(self) -> TemplateArgs | None:
        """`think` as templates read it: `enable_thinking`, and a level as
        `reasoning_effort` (gpt-oss's template reads it)."""
        if self.think is None:
            return None
        if isinstance(self.think, bool):
            return TemplateArgs(variables={"enable_thinking": self.think})
        if self.think not in THINK_LEVELS:
            levels = ", ".join(f'"{t}"' for t in THINK_LEVELS)
            raise InvalidRequestError(f"think must be true, false or one of {levels}", "think")
        return TemplateArgs(variables={"enable_thinking": True, "reasoning_effort": self.think})

    def constraint(self) -> Constraint | None:
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return Constraint(kind="json", spec='{"type": "object"}')
        if not isinstance(self.format, dict):
            raise InvalidRequestError('format must be "json" or a JSON schema', "format")
        spec = json.dumps(self.format)
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"format is over {MAX_CONSTRAINT_CHARS} characters", "format")
        return Constraint(kind="json", spec=spec)


class OllamaGenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    template: str | None = Field(None, max_length=MAX_TEMPLATE_BYTES)
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None  # base64, read by a model that reads images
    suffix: str | None = None  # not served: refused when given


class OllamaFunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: OllamaFunctionCall


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # base64, read by a model that reads images
    tool_calls: list[OllamaToolCall] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # the tool a tool message answers

    def template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.images:
            message["content"] = with_images(self.content, self.images)
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": c.function.model_dump()} for c in self.tool_calls
            ]
        if self.tool_name:
            message["name"] = self.tool_name
        return message


def with_images(text: str, images: list[str]) -> list[dict[str, Any]]:
    """A message's images (base64), then its text, as the chat turn's parts: Ollama shows
    a model a message's images before its words."""
    parts = [{"type": "image", "image": base64_bytes(b, "images")} for b in images]
    return [*parts, {"type": "text", "text": text}]


class OllamaChatRequest(OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDef] | None = None  # OpenAI's shape; the model decides when to call


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str | list[str]
    truncate: bool = True  # an input over the model's length is cut to fit; else a 400


class OllamaLegacyEmbedRequest(BaseModel):
    """/api/embeddings, the older single-prompt form."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str


class OllamaShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None  # older clients
