"""OpenAI request schemas and their mapping onto neutral SamplingParams.

Strict, as OpenAI is: an unknown field is a 400 that names it ("Unrecognized request
argument supplied"), and a field of OpenAI's API that this server does not honour yet
(audio, prediction, ...) is a 400 that says so, rather than a 200 that silently
ignores it. Structured outputs and tools are in deployments.api.structured. Such a field is accepted only with a value that asks for nothing (`tools: []`,
`response_format: {"type": "text"}`). vLLM's sampling extensions that are honoured are
accepted too. Ranges are OpenAI's (temperature 0-2, ...).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import PromptEnding, TemplateArgs
from app.protocol.sampling import (
    MAX_LOGIT_BIAS,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    Constraint,
    SamplingParams,
)
from app.protocol.sampling import sampling_params as build_sampling_params
from app.text.images import image_url_part
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.api.prompts import prompt_object_text
from deployments.api.structured import StructuredFields, ToolFields, drop_inert

# Fields of OpenAI's (or vLLM's) API that a later feature will honour; until then a request
# that uses one gets a 400 naming it. The value that asks for nothing is accepted.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "dimensions": (None,),
}
NOT_SUPPORTED = "is not supported by this server"

StopList = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]


def drop_inert_fields(data: Any) -> Any:
    return drop_inert(data, UNSUPPORTED_FIELDS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(StructuredFields):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the one model served (see Ingress.served_name)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | StopList | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # Extensions that vLLM accepts too (pass them with the SDK's `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)

    _inert = model_validator(mode="before")(drop_inert_fields)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return check_stop_strings(stops, "stop")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # audio parts and the like: refused by type
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None  # {"url": a data or http(s) URL, "detail": ...}

    def image(self) -> dict[str, Any]:
        """An image_url part as the chat turn takes images."""
        url = (self.image_url or {}).get("url")
        if not isinstance(url, str):
            raise InvalidRequestError("an image_url part needs image_url.url", "messages")
        return image_url_part(url, "messages")


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def template_call(self) -> dict[str, Any]:
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError) as exc:  # nesting past the parser's depth too
            raise InvalidRequestError(
                f"tool call {self.id!r}: arguments are not valid JSON ({exc})", "messages"
            ) from exc
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    # A reasoning model's thinking in an earlier assistant turn (llama.cpp's and vLLM's
    # field): given to the chat template, which decides whether to show it.
    reasoning_content: str | None = None
    function_call: dict[str, Any] | None = None  # the deprecated form: refused

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.function_call:
            raise InvalidRequestError(f"messages[].function_call {NOT_SUPPORTED}", "messages")
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("only assistant messages have tool_calls", "messages")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequestError("a tool message needs tool_call_id", "messages")
        return self

    def template_message(self) -> dict[str, Any]:
        """This message as chat templates take it: tool call arguments as objects."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if isinstance(self.content, list) and any(p.type == "image_url" for p in self.content):
            message["content"] = [  # the chat turn's parts: text and images' bytes
                p.image() if p.type == "image_url" else {"type": "text", "text": _text(p)}
                for p in self.content
            ]
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.template_call() for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content and self.role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(_text(p) for p in self.content if p.type != "image_url")


def _text(part: ContentPart) -> str:
    if part.type != "text" or part.text is None:
        raise InvalidRequestError(
            f"content parts of type {part.type!r} are not supported", param="messages"
        )
    return part.text


class ChatCompletionRequest(ToolFields, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: the last (assistant) message is the reply's start, which the model goes on
    # with (a prefill), rather than a turn it answers. It renders no generation prompt.
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    timings_per_token: bool = False  # llama.cpp's: timings in every streamed chunk
    return_progress: bool = False  # llama.cpp's: the prompt's progress in a stream
    # llama.cpp's slot to run in, for its cache: accepted (in range); any of Shoal's
    # sequences reuses any cached prefix, so the slot changes nothing.
    id_slot: int = -1
    # vLLM's: the request's own Jinja template (rendered sandboxed and bounded), and more
    # variables for the template (e.g. enable_thinking).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _prefill(self) -> "ChatCompletionRequest":
        if self.continue_final_message:
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise InvalidRequestError(  # vLLM's and llama.cpp's rule
                    "add_generation_prompt and continue_final_message cannot both be true",
                    "add_generation_prompt",
                )
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError(
                    "continue_final_message needs an assistant message last", "messages"
                )
        return self

    @property
    def prompt_ending(self) -> PromptEnding:
        if self.continue_final_message:
            return "continue"
        return "reply" if self.add_generation_prompt else "none"

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_args(self) -> TemplateArgs | None:
        return TemplateArgs.checked(self.chat_template, self.chat_template_kwargs)


EmbeddingPiece = int | str  # a token id of the embedding model's vocabulary, or text
EmbeddingItem = EmbeddingPiece | list[EmbeddingPiece] | dict[str, Any]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[EmbeddingItem] | dict[str, Any]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    _inert = model_validator(mode="before")(drop_inert_fields)

    def inputs(self) -> list[str | list[EmbeddingPiece]]:
        """One entry per vector: a text, or token ids (with texts mixed in, as llama.cpp
        takes them). A flat list of ids (or ids and texts) is one input; a list of texts,
        id lists or llama.cpp's objects ({"prompt_string": ...}, {"content": [text
        parts]}) is one input each."""
        x = self.input
        if isinstance(x, str | dict):
            items: list = [x]
        elif x and all(isinstance(i, int | str) for i in x) and any(isinstance(i, int) for i in x):
            items = [x]
        else:
            items = list(x)
        if not items:
            raise InvalidRequestError("input must not be empty", "input")
        return [_embedding_input(item) for item in items]


def _embedding_input(item: Any) -> str | list[EmbeddingPiece]:
    if isinstance(item, dict):
        item = prompt_object_text(item, "input")
    if isinstance(item, int):
        item = [item]
    if not item:  # OpenAI refuses an empty string, llama.cpp embeds it: OpenAI's way here
        raise InvalidRequestError("input must not contain an empty string or list", "input")
    if isinstance(item, list) and any(isinstance(p, list | dict) for p in item):
        raise InvalidRequestError("an input is text, token ids, or both in one list", "input")
    return item


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    default_max_tokens: int,
    num_logprobs: int | None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """`constraint`: what the output must match (from the request's structured-output
    fields, or a forced tool call)."""
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
        stop_token_ids=tuple(req.stop_token_ids or ()),
        constraint=constraint,
    )
    names = {}
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return build_sampling_params(fields, names)
