"""Anthropic's Messages API request schemas, and their mapping onto chat-template
messages, tools and neutral SamplingParams.

Strict like the OpenAI schemas: an unknown field is a 400 naming it, and a content block
this server cannot honour (documents) is a 400 that says so. Image blocks (base64 data)
become the chat turn's image parts, read by models that read images. A last
assistant message is a prefill: the reply continues it. `thinking` reaches the chat
template as `enable_thinking` (enabled: true, disabled: false, adaptive: the template's
default); a reasoning model's thinking comes back as thinking blocks, and thinking
blocks of earlier turns reach the template as `reasoning_content`.
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import PromptEnding, TemplateArgs
from app.protocol.sampling import (
    MAX_CONSTRAINT_CHARS,
    MAX_SEED,
    Constraint,
    SamplingParams,
    sampling_params,
)
from app.text.images import base64_bytes, image_url_part
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.api.structured import (
    MAX_TOOLS,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolDef,
    ToolFields,
)

NOT_SUPPORTED = "is not supported by this server"


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a caching hint: every prefix is cached
    citations: list[Any] | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    def blocks(self) -> list[dict[str, Any]]:
        if isinstance(self.content, str):
            return [{"type": "text", "text": self.content}]
        return self.content


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    # How hard a reasoning model thinks: accepted; the templates served here take no
    # level, only whether to think (`thinking`).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(BaseModel):
    """What decides a request's prompt: the body of /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # None: the one model served
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # constrains the reply, not the prompt
    # Accepted, and the prompt does not depend on them: cache hints (every prompt
    # prefix is cached anyway), how fast it runs, and who asks.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> "CountTokensRequest":
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise InvalidRequestError("tool_choice of type tool needs a name", "tool_choice")
        self.tool_fields()  # names unique, a named choice among them
        return self

    @property
    def prompt_ending(self) -> PromptEnding:
        """A last assistant message of text is a prefill: the reply goes on from it (an
        empty one, which the API allows, from the start of the turn). One that ends in
        tool uses is a finished turn."""
        last = self.messages[-1]
        if last.role == "assistant" and all(b.get("type") == "text" for b in last.blocks()):
            return "continue"
        return "reply"

    def template_args(self) -> TemplateArgs | None:
        """`thinking` as templates read it (Qwen3's and the like: `enable_thinking`)."""
        kind = self.thinking.type if self.thinking is not None else "adaptive"
        if kind == "adaptive":
            return None
        return TemplateArgs(variables={"enable_thinking": kind == "enabled"})

    def tool_fields(self) -> ToolFields:
        """The tools and choice as the OpenAI tool machinery takes them."""
        tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
                    name=t.name, description=t.description, parameters=t.input_schema
                ),
            )
            for t in self.tools or []
        ]
        choice = self.tool_choice
        kind = None if choice is None else choice.type
        named = None
        if kind == "tool":
            named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        openai_choice = {"auto": "auto", "any": "required", "none": "none", None: None}
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        return ToolFields(
            tools=tools or None,
            tool_choice=named or openai_choice[kind],
            parallel_tool_calls=parallel,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it (OpenAI's roles): the system
        prompt, then each message, tool results as `tool` messages and tool uses as an
        assistant's `tool_calls`."""
        out: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):
            system = "".join(b.text for b in system)
        if system:
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            out += _template_messages(message, f"messages.{i}")
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    # Sampling: the API's older fields, which its current SDK sends only as extra_body.
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # not Anthropic's: vLLM's extension
    # Accepted, and nothing here depends on them: who asks, where it runs, and the
    # prompt-cache report against an earlier message (not kept here).
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    container: None = Field(None, description="Code-execution containers: not served.")

    def output_constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return None
        spec = json.dumps(fmt.schema_)
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError("output_config.format.schema is too large", "output_config")
        return Constraint(kind="json", spec=spec)

    @property
    def stop_strings(self) -> list[str]:
        return check_stop_strings(list(self.stop_sequences or ()), "stop_sequences")

    def params(self, constraint: Any = None) -> SamplingParams:
        fields = dict(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            constraint=constraint,
        )
        return sampling_params(fields)


def _template_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: a user message's tool results each
    become a `tool` message (before its text), an assistant's tool uses its
    `tool_calls`."""
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, where images come
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.blocks():
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, where).text)
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and message.role == "user":
            parts.append(_image_part(block, where))
        elif kind == "thinking" and message.role == "assistant":
            thoughts.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and message.role == "assistant":
            continue  # encrypted by the service that made it: nothing to show a template
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, where))
        else:
            raise InvalidRequestError(
                f"{where}: {message.role} content blocks of type {kind!r} {NOT_SUPPORTED}",
                "messages",
            )
    out: list[dict[str, Any]] = list(results)
    if len(parts) > len(texts):  # images: the chat turn's parts
        out.append({"role": message.role, "content": parts})
    elif texts or calls or not results:
        entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        if thoughts:
            entry["reasoning_content"] = "".join(thoughts)
        out.append(entry)
    return out


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as the chat turn takes it: base64 data, or a URL (data or http(s):
    the ingress fetches an http(s) one where the config allows)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequestError(f"{where}: an image block needs a source", "messages")
    if source.get("type") == "url":
        return image_url_part(str(source.get("url", "")), "messages")
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise InvalidRequestError(f"{where}: an image source is base64 data or a URL", "messages")
    return {"type": "image", "image": base64_bytes(source["data"], "messages")}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidRequestError(f"{where}: a tool_use block needs id and name", "messages")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}: a tool_use block's input is an object", "messages")
    function = {"name": block["name"], "arguments": arguments}
    return {"id": block["id"], "type": "function", "function": function}


def _text_block(block: dict[str, Any], where: str) -> TextBlock:
    try:
        return TextBlock.model_validate(block)
    except ValidationError as exc:  # a block inside free-form content: a 400 naming it
        problem = exc.errors()[0]
        at = ".".join(str(p) for p in problem["loc"])
        raise InvalidRequestError(
            f"{where}: text block: {at}: {problem['msg']}", "messages"
        ) from None


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{where}: a tool_result block needs tool_use_id", "messages")
    content = block.get("content", "")
    error = "Error: " if block.get("is_error") else ""
    if isinstance(content, list):
        parts = [{"type": "text", "text": error}] if error else []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                parts.append(_image_part(part, where))
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise InvalidRequestError(
                    f"{where}: tool_result content is text and image blocks", "messages"
                )
        if any(p["type"] == "image" for p in parts):  # the chat turn's parts, images in place
            return {"role": "tool", "tool_call_id": call_id, "content": parts}
        content = "".join(p["text"] for p in parts)
        error = ""
    elif not isinstance(content, str):
        content = json.dumps(content)
    return {"role": "tool", "tool_call_id": call_id, "content": error + content}
