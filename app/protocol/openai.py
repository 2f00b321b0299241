"""OpenAI request schemas and their mapping onto neutral SamplingParams."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import SamplingParams
from app.protocol.sampling import sampling_params as build_sampling_params


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM accepts too (pass them with the SDK's `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported", param="messages"
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
        return out


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    default_max_tokens: int,
    num_logprobs: int | None,
) -> SamplingParams:
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError as exc:
            raise InvalidRequestError(
                f"logit_bias key {key!r} is not a token id", "logit_bias"
            ) from exc
    fields = dict(
        n=req.n,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        logprobs=num_logprobs,
        top_k=0 if req.top_k in (None, -1) else req.top_k,  # vLLM: -1 is "off"
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
    )
    names = {}
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return build_sampling_params(fields, names)
