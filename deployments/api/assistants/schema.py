"""OpenAI's Assistants v2 request bodies, as the official SDK sends them
(`client.beta.assistants`, `client.beta.threads`, `.messages`, `.runs`).

Served tools: `function` and `file_search`; `code_interpreter` (as a tool, a tool
resource or an attachment's tool) is a 400 that says it is not served, never a silent
default. Every response_format is served (text, json_object, json_schema).
"""

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.protocol.errors import ShoalError
from app.protocol.sampling import Constraint
from deployments.api.assistants.tool_schema import (
    MAX_TOOLS,
    RESULTS_CONTENT,
    Attachment,
    FileSearchChoice,
    Tool,
    ToolResources,
    check_tools,
    existing_stores,
)
from deployments.api.structured import NamedToolChoice, ResponseFormat, StructuredFields

MAX_METADATA_PAIRS = 16
MAX_MESSAGE_CHARS = 256_000  # OpenAI's limit on one message's content
MAX_ATTACHMENTS = 20  # files one message brings


class Body(BaseModel):
    # Unknown fields are refused by name (the SDK's newer fields included), not dropped.
    model_config = ConfigDict(extra="forbid")

    def set_fields(self, *names: str) -> dict:
        """The fields the client sent, by the given names (an update touches only those)."""
        return {n: getattr(self, n) for n in names if n in self.model_fields_set}


def check_metadata(value: dict | None) -> dict | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs")
    for k, v in value.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise ValueError("metadata keys are at most 64 characters, values strings of 512")
    return value


class WithMetadata(Body):
    metadata: dict[str, Any] | None = None

    _metadata = field_validator("metadata")(check_metadata)


def check_unserved(tools: list | None, response_format: Any) -> None:
    """Every response_format is served (text, json_object, json_schema); the tools'
    names are unique."""
    check_tools(tools)
    output_constraint(response_format)


def output_constraint(response_format: Any) -> Constraint | None:
    """What a run's output must match, from its (or its assistant's) response_format."""
    if response_format in (None, "auto"):
        return None
    try:
        parsed = ResponseFormat.model_validate(response_format)
    except ValidationError as exc:
        raise ValueError(f"response_format: {exc.errors()[0]['msg']}") from None
    try:
        return StructuredFields(response_format=parsed).output_constraint()
    except ShoalError as exc:
        raise ValueError(exc.message) from None


class Sampling(WithMetadata):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    response_format: Any = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _served(self) -> "Sampling":
        check_unserved(self.tools, self.response_format)
        return self


class AssistantUpdate(Sampling):
    model: str | None = None
    name: str | None = Field(None, max_length=256)
    description: str | None = Field(None, max_length=512)
    instructions: str | None = Field(None, max_length=256_000)
    tool_resources: ToolResources | None = None
    reasoning_effort: str | None = None

    _existing_stores = field_validator("tool_resources")(existing_stores)


class AssistantCreate(AssistantUpdate):
    model: str


class TextPart(Body):
    type: Literal["text"]
    text: str


class MessageCreate(WithMetadata):
    role: Literal["user", "assistant"]
    content: str | list[TextPart] = Field(max_length=MAX_MESSAGE_CHARS)
    attachments: list[Attachment] | None = Field(None, max_length=MAX_ATTACHMENTS)

    @field_validator("content")
    @classmethod
    def _bounded(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        size = len(value) if isinstance(value, str) else sum(len(p.text) for p in value)
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(f"a message's content is at most {MAX_MESSAGE_CHARS:,} characters")
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @property
    def searched_files(self) -> list[str]:
        """The files it brings for file_search (they go into its thread's store)."""
        return [
            a.file_id
            for a in self.attachments or []
            if any(t.type == "file_search" for t in a.tools)
        ]

    def fields(self) -> dict:
        attachments = [a.model_dump() for a in self.attachments or []]
        return {
            "role": self.role,
            "text": self.text,
            "meta": self.metadata or {},
            "attachments": attachments,
        }


class MessageUpdate(WithMetadata):
    pass


class ThreadCreate(WithMetadata):
    messages: list[MessageCreate] = Field(default_factory=list, max_length=32)
    tool_resources: ToolResources | None = None

    @property
    def searched_files(self) -> list[str]:
        return [f for m in self.messages for f in m.searched_files]


class ThreadUpdate(WithMetadata):
    tool_resources: ToolResources | None = None


class RunCreate(Sampling):
    assistant_id: str
    model: str | None = None
    instructions: str | None = None
    additional_instructions: str | None = None
    additional_messages: list[MessageCreate] | None = Field(None, max_length=32)
    max_prompt_tokens: int | None = Field(None, ge=256)
    max_completion_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    truncation_strategy: dict | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | FileSearchChoice | None = (
        None
    )
    parallel_tool_calls: bool | None = None
    include: list[Literal[RESULTS_CONTENT]] | None = None
    reasoning_effort: str | None = None

    @field_validator("truncation_strategy")
    @classmethod
    def _auto_only(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type", "auto") != "auto":
            raise ValueError("only the 'auto' truncation strategy is served")
        return value


class ThreadAndRunCreate(RunCreate):
    thread: ThreadCreate | None = None
    tool_resources: ToolResources | None = None  # instead of the assistant's, for this run

    _existing_stores = field_validator("tool_resources")(existing_stores)


class ToolOutput(Body):
    tool_call_id: str
    output: str = Field("", max_length=MAX_MESSAGE_CHARS)


class SubmitToolOutputs(Body):
    tool_outputs: list[ToolOutput] = Field(max_length=MAX_TOOLS)
    stream: bool = False
