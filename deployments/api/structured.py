"""OpenAI's (and vLLM's) fields for structured outputs and tools, and their mapping onto
a neutral Constraint.

Structured outputs, one of: `response_format` (`json_object`, `json_schema`), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or vLLM's newer
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`), or
llama.cpp's `json_schema` / `grammar` (and its `json_object` with a `schema`).
Tools: `tools`, `tool_choice` (`none`, `auto`, `required`, or a named function) and
`parallel_tool_calls`; `required` and a named function are enforced by a grammar, so the
arguments always parse against the function's schema.
"""

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind
from deployments.http.chat_turn import ToolName

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for names
ANY_OBJECT = '{"type": "object"}'


def drop_inert(data: Any, inert: dict[str, tuple[Any, ...]]) -> Any:
    """Remove the fields of `inert` (not served here) whose value is one that asks for
    nothing (the API's default: no tools, false...); any other value of them is a 400."""
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        values = inert.get(key)
        if values is None:
            kept[key] = value
        elif not any(value == v and type(value) is type(v) for v in values):
            raise InvalidRequestError(f"{key} is not supported by this server", param=key)
    return kept


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's: a json_object that must match this schema.
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (pass it with the SDK's `extra_body`)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> "FunctionDef":
        if not FUNCTION_NAME.match(self.name):
            raise InvalidRequestError(
                f"tools: function name {self.name!r} must be 1-64 letters, digits, _ . or -",
                "tools",
            )
        return self


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


def _schema_text(value: dict | str | bool | None, param: str) -> str:
    if value is None:
        return ANY_OBJECT
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            f"{param}: the schema is over {MAX_CONSTRAINT_CHARS} characters", param
        )
    return text


class StructuredFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's names for the same two
    grammar: str | None = None

    def output_constraint(self) -> Constraint | None:
        """The one constraint the request asks for (400 when it asks for two)."""
        asked: list[tuple[str, Constraint]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            spec = _schema_text(rf.schema_, "response_format")
            asked.append(("response_format", Constraint(kind="json", spec=spec)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format.json_schema.schema is required", "response_format"
                )
            spec = _schema_text(rf.json_schema.schema_, "response_format")
            asked.append(("response_format", Constraint(kind="json", spec=spec)))
        so = self.structured_outputs
        pairs: list[tuple[str, Any, ConstraintKind]] = [
            ("guided_json", self.guided_json, ConstraintKind.JSON),
            ("guided_regex", self.guided_regex, ConstraintKind.REGEX),
            ("guided_choice", self.guided_choice, ConstraintKind.CHOICE),
            ("guided_grammar", self.guided_grammar, ConstraintKind.GRAMMAR),
            ("json_schema", self.json_schema, ConstraintKind.JSON),
            ("grammar", self.grammar, ConstraintKind.GRAMMAR),
        ]
        if so is not None:
            pairs += [
                ("structured_outputs.json", so.json_, ConstraintKind.JSON),
                ("structured_outputs.regex", so.regex, ConstraintKind.REGEX),
                ("structured_outputs.choice", so.choice, ConstraintKind.CHOICE),
                ("structured_outputs.grammar", so.grammar, ConstraintKind.GRAMMAR),
                ("structured_outputs.json_object", so.json_object or None, ConstraintKind.JSON),
            ]
        for param, value, kind in pairs:
            if value is None:
                continue
            if kind is ConstraintKind.JSON:
                spec = ANY_OBJECT if value is True else _schema_text(value, param)
            elif kind is ConstraintKind.CHOICE:
                if not value:
                    raise InvalidRequestError(f"{param} must not be empty", param)
                spec = json.dumps(value)
            else:
                spec = value
            if len(spec) > MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError(
                    f"{param} is over {MAX_CONSTRAINT_CHARS} characters", param
                )
            asked.append((param, Constraint(kind=kind, spec=spec)))
        if len(asked) > 1:
            names = ", ".join(p for p, _ in asked)
            raise InvalidRequestError(
                f"ask for one structured output at a time, not {names}", asked[1][0]
            )
        return asked[0][1] if asked else None


class ToolFields(BaseModel):
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> "ToolFields":
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: function names must be unique", "tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
            )
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether the model sees the tools and its output is read for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        if not self.uses_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def turn_tools(self) -> dict[str, Any]:
        """The tools in a ChatTurn's terms (deployments/http/chat_turn.py)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = ToolName(choice.function.name)
        elif choice in (None, "none"):
            choice = "auto"  # with "none", no tools are shown at all
        return {
            "tools": self.template_tools(),
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
