"""OpenAI's Responses API request schema, and its mapping onto chat-template messages,
tools, a constraint and neutral SamplingParams.

Strict like the other OpenAI schemas: an unknown field is a 400 naming it; a field this
server does not honour is accepted only with a value that asks for nothing. Input items
(items.py) are messages (text parts only), function calls and their outputs, and
reasoning items (an earlier turn's thinking, given to the template with the assistant
turn after it), each with exactly its own fields. The Conversations API's bodies
(conversations.py) are here too: their items are checked as input items are.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import Constraint, SamplingParams, sampling_params
from deployments.api.responses.items import (
    NOT_SUPPORTED,
    FunctionCallItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    input_items,
)
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

# Fields this server does not honour, with the values that ask for nothing.
INERT_FIELDS: dict[str, tuple[Any, ...]] = {
    "reasoning": (None, {}),
    "background": (None, False),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "truncation": (None, "disabled"),
    "context_management": (None,),
    "moderation": (None,),
}


# OpenAI's metadata: 16 pairs at most, keys of 64 characters, values of 512.
Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=16),
]


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=128)


class ConversationCreate(BaseModel):
    """POST /v1/conversations: `items` are checked as Responses input items are
    (item_messages.new_items), up to 20."""

    model_config = ConfigDict(extra="forbid")
    metadata: Metadata | None = None
    items: list[Any] | None = None


class ConversationUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: Metadata | None  # required, as OpenAI's: null clears it


class ItemsCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Any] = Field(min_length=1)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class RankingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ranker: Literal["auto", "default-2024-11-15", "none"] = "auto"
    score_threshold: float = Field(0.0, ge=0.0, le=1.0)


class FileSearchTool(BaseModel):
    """The file_search tool: the stores to search (deployments/api/responses/file_search.py)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["file_search"]
    vector_store_ids: list[Annotated[str, Field(max_length=64)]] = Field(min_length=1, max_length=8)
    max_num_results: int | None = Field(None, ge=1, le=50)
    ranking_options: RankingOptions | None = None
    filters: dict[str, Any] | None = None


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
    input: str | list[Any]  # list: InputItems (items.py), checked one by one
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to hide
    tools: list[FunctionTool | FileSearchTool | dict[str, Any]] | None = Field(
        None, max_length=MAX_TOOLS
    )
    # What the response carries beyond the default: the file search's results.
    include: list[Literal["file_search_call.results"]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    previous_response_id: str | None = Field(None, max_length=128)
    conversation: Annotated[str, Field(max_length=128)] | ConversationRef | None = None
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

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return input_items(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        for tool in self.tools or []:
            if isinstance(tool, dict):
                kind = tool.get("type")
                raise InvalidRequestError(f"tools of type {kind!r} {NOT_SUPPORTED}", "tools")
        if not self.input:
            raise InvalidRequestError("input must not be empty", "input")
        if self.conversation is not None and self.previous_response_id is not None:
            raise InvalidRequestError(
                "Mutually exclusive parameters: Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'.",
                "conversation",
            )
        if len([t for t in self.tools or [] if isinstance(t, FileSearchTool)]) > 1:
            raise InvalidRequestError("give at most one file_search tool", "tools")
        self.tool_fields()  # unique names, a named choice among them
        return self

    def file_search(self) -> FileSearchTool | None:
        return next((t for t in self.tools or [] if isinstance(t, FileSearchTool)), None)

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
        """The input as a list of items, as the client gave them (a string is one user
        message): what a stored response lists."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(exclude_unset=True) for item in self.input]

    def conversation_id(self) -> str | None:
        ref = self.conversation
        return ref.id if isinstance(ref, ConversationRef) else ref

    def checked_input(self) -> list[InputItem]:
        """The input as checked items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return self.input

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat-template messages: function calls become an
        assistant's tool_calls (consecutive ones, one message), their outputs tool
        messages, reasoning items the next assistant message's reasoning_content."""
        items = self.checked_input()
        out: list[dict[str, Any]] = []
        thinking: list[str] = []  # reasoning items waiting for their assistant turn
        for i, item in enumerate(items):
            if isinstance(item, ReasoningItem):
                thinking.append(item.text())
                continue
            if isinstance(item, FunctionCallItem):
                call = item.call(f"input[{i}]")
                last = out[-1] if out else None
                if last and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append(item.message())
            if thinking and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = "".join(thinking)
                thinking = []
        return out
