"""OpenAI's Responses API request schema, and its mapping onto chat-template messages,
tools, a constraint and neutral SamplingParams.

Strict like the other OpenAI schemas: an unknown field is a 400 naming it; a field this
server does not honour is accepted only with a value that asks for nothing. Input items
are messages (text parts only), function calls and their outputs, and reasoning items
(an earlier turn's thinking, given to the template with the assistant turn after it).
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import Constraint, SamplingParams, sampling_params
from deployments.api.structured import (
    MAX_TOOLS,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StructuredFields,
    ToolDef,
    ToolFields,
    drop_inert,
)

NOT_SUPPORTED = "is not supported by this server"
# Fields this server does not honour, with the values that ask for nothing.
INERT_FIELDS: dict[str, tuple[Any, ...]] = {
    "reasoning": (None, {}),
    "include": (None, []),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "context_management": (None,),
    "moderation": (None,),
}
TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint models here ignore


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the one model served
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to hide
    tools: list[FunctionTool | dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    previous_response_id: str | None = Field(None, max_length=128)
    # Who asks and cache hints: accepted; nothing here depends on them.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: Literal["auto", "default"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _inert(cls, data: Any) -> Any:
        return drop_inert(data, INERT_FIELDS)

    @model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        for tool in self.tools or []:
            if isinstance(tool, dict):
                kind = tool.get("type")
                raise InvalidRequestError(f"tools of type {kind!r} {NOT_SUPPORTED}", "tools")
        if not self.input:
            raise InvalidRequestError("input must not be empty", "input")
        self.tool_fields()  # unique names, a named choice among them
        return self

    def tool_fields(self) -> ToolFields:
        tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in self.tools or []
            if isinstance(t, FunctionTool)
        ]
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return ToolFields(
            tools=tools or None, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls
        )

    def output_constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            rf = ResponseFormat(type="json_object")
        else:
            if fmt.schema_ is None:
                raise InvalidRequestError("text.format.schema is required", "text")
            schema = JsonSchemaFormat.model_validate(
                {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            )
            rf = ResponseFormat(type="json_schema", json_schema=schema)
        return StructuredFields(response_format=rf).output_constraint()

    def params(self, default_max_tokens: int, constraint: Constraint | None) -> SamplingParams:
        fields = dict(
            max_tokens=self.max_output_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            constraint=constraint,
        )
        return sampling_params(fields, {"max_tokens": "max_output_tokens"})

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat-template messages: function calls become an
        assistant's tool_calls (consecutive ones, one message), their outputs tool
        messages, reasoning items the next assistant message's reasoning_content."""
        out: list[dict[str, Any]] = []
        thinking: list[str] = []  # reasoning items waiting for their assistant turn
        for i, item in enumerate(self.input_items()):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if kind == "reasoning":
                thinking.append(_reasoning_text(item, where))
                continue
            if kind == "message":
                out.append(_message(item, where))
            elif kind == "function_call":
                call = _function_call(item, where)
                last = out[-1] if out else None
                if last and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append(_function_output(item, where))
            else:
                raise InvalidRequestError(
                    f"{where}: items of type {kind!r} {NOT_SUPPORTED}", "input"
                )
            if thinking and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = "".join(thinking)
                thinking = []
        return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequestError(
            f"{where}: role must be user, assistant, system or developer", "input"
        )
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"{where}: content parts of type {kind!r} {NOT_SUPPORTED}", "input"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{where}: content is text or a list of text parts", "input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise InvalidRequestError(f"{where}: a reasoning item's parts are text", "input")
    return "".join(p["text"] for p in parts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(f"{where}: a function_call needs {key}", "input")
    try:
        arguments = json.loads(item["arguments"])
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"{where}: arguments are not valid JSON ({exc})", "input"
        ) from exc
    function = {"name": item["name"], "arguments": arguments}
    return {"id": item["call_id"], "type": "function", "function": function}


def _function_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise InvalidRequestError(f"{where}: a function_call_output needs call_id", "input")
    output = item.get("output", "")
    if isinstance(output, list):  # input_text parts: their text (other parts as JSON)
        output = "".join(
            p["text"] if isinstance(p, dict) and p.get("type") == "input_text" else json.dumps(p)
            for p in output
        )
    elif not isinstance(output, str):
        output = json.dumps(output)
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
