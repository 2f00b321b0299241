"""The tools of OpenAI's Assistants v2 bodies (schema.py): `function` and `file_search`
tools, their `tool_resources`, a run's `tool_choice`, and a message's `attachments`.
`code_interpreter` (a tool, a tool resource, an attachment's tool) is refused by name: a
400 that says it is not served, never a silent default."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.protocol.errors import InvalidRequestError
from deployments.api.structured import FunctionDef, NamedToolChoice

MAX_TOOLS = 128  # OpenAI's limit on an assistant's (or a run's) tools
# The only `include` OpenAI takes: a file_search step's results with their text.
RESULTS_CONTENT = "step_details.tool_calls[*].file_search.results[*].content"
NOT_SERVED = "code_interpreter is not served by this server; use function or file_search tools"


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as schema.py's: unknown fields refused


class RankingOptions(Body):
    ranker: Literal["auto", "default_2024_08_21"] = "auto"
    score_threshold: float = Field(0.0, ge=0, le=1)


class FileSearchSettings(Body):
    max_num_results: int | None = Field(None, ge=1, le=50)
    ranking_options: RankingOptions | None = None


class FileSearchTool(Body):
    type: Literal["file_search"]
    file_search: FileSearchSettings | None = None


class FunctionTool(Body):
    type: Literal["function"]
    function: FunctionDef


class CodeInterpreter(Body):
    """Named only to be refused by name (not as an unknown tool)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["code_interpreter"]

    @model_validator(mode="after")
    def _refused(self) -> "CodeInterpreter":
        raise ValueError(NOT_SERVED)


Tool = Annotated[FunctionTool | FileSearchTool | CodeInterpreter, Field(discriminator="type")]


def check_tools(tools: list | None) -> list | None:
    if tools is None:
        return None
    names = [t.function.name for t in tools if isinstance(t, FunctionTool)]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if sum(isinstance(t, FileSearchTool) for t in tools) > 1:
        raise ValueError("tools: give at most one file_search tool")
    return tools


def dump_tools(tools: list | None) -> list[dict]:
    """The tools as stored and shown (OpenAI's shape)."""
    return [t.model_dump(exclude_none=True) for t in tools or []]


class NewVectorStore(Body):
    """`tool_resources.file_search.vector_stores`: a store made for a thread from files."""

    file_ids: list[str] = Field(default_factory=list, max_length=500)


class FileSearchResources(Body):
    vector_store_ids: list[str] = Field(default_factory=list, max_length=1)
    vector_stores: list[NewVectorStore] = Field(default_factory=list, max_length=1)

    @model_validator(mode="after")
    def _one(self) -> "FileSearchResources":
        if self.vector_store_ids and self.vector_stores:
            raise ValueError("file_search takes one vector store: an id or a new one, not both")
        return self


class CodeInterpreterResources(Body):
    file_ids: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _refused(self) -> "CodeInterpreterResources":
        if self.file_ids:
            raise ValueError(NOT_SERVED)
        return self


class ToolResources(Body):
    file_search: FileSearchResources | None = None
    code_interpreter: CodeInterpreterResources | None = None

    @property
    def store_ids(self) -> list[str]:
        return list(self.file_search.vector_store_ids) if self.file_search else []

    @property
    def new_files(self) -> list[str]:
        """The files of the store it asks to make, if any."""
        stores = self.file_search.vector_stores if self.file_search else []
        return [f for store in stores for f in store.file_ids]


def existing_stores(value: ToolResources | None) -> ToolResources | None:
    """An assistant's (or a run's) stores are named, not made from files."""
    if value is not None and value.new_files:
        raise ValueError(
            "file_search here takes vector_store_ids: make the store with /v1/vector_stores "
            "first (vector_stores is served on threads)"
        )
    return value


class FileSearchChoice(Body):
    type: Literal["file_search"]


def check_choice(choice: object, tools: list[dict]) -> None:
    """A run's tool_choice names a tool the run has (its own tools or its assistant's)."""
    kinds = {t["type"] for t in tools}
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools if t["type"] == "function"]
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the run's tools",
                "tool_choice",
            )
    elif isinstance(choice, FileSearchChoice) and "file_search" not in kinds:
        raise InvalidRequestError(
            "tool_choice names file_search, which the run has not", "tool_choice"
        )
    elif choice == "required" and not kinds:
        raise InvalidRequestError("tool_choice 'required' needs tools", "tool_choice")


class AttachmentTool(Body):
    type: Literal["file_search", "code_interpreter"]

    @model_validator(mode="after")
    def _served(self) -> "AttachmentTool":
        if self.type == "code_interpreter":
            raise ValueError(NOT_SERVED)
        return self


class Attachment(Body):
    file_id: str
    tools: list[AttachmentTool] = Field(default_factory=list)
