"""The Responses API's input items, strictly: messages (text and image parts), function
calls and their outputs, and reasoning items, each with exactly the fields OpenAI gives it.

An unknown field or item type is a 400 that names it, and the number of items and of
parts is bounded: memory, not only JSON length, is what a request pins while it runs
and what a stored response keeps (an `{}` item is 4 bytes of JSON and ~90 in memory).
"""

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.protocol.errors import InvalidRequestError
from app.text.images import image_url_part

NOT_SUPPORTED = "is not supported by this server"
MAX_INPUT_ITEMS = 2_048  # a conversation's turns, well past what a context window holds
MAX_PARTS = 256  # content parts in one item
MAX_ANNOTATIONS = 256
TEXT_PARTS = ("input_text", "output_text", "text")
Status = Literal["in_progress", "completed", "incomplete"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Annotation(Strict):
    """A citation on an earlier answer's text (kept as given, not used)."""

    type: str = Field(max_length=64)
    index: int | None = None
    file_id: str | None = Field(None, max_length=256)
    filename: str | None = Field(None, max_length=1024)
    container_id: str | None = Field(None, max_length=256)
    url: str | None = Field(None, max_length=8192)
    title: str | None = Field(None, max_length=1024)
    start_index: int | None = None
    end_index: int | None = None


class TopLogprob(Strict):
    token: str
    bytes: list[int] = Field(default_factory=list, max_length=64)
    logprob: float


class Logprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list, max_length=20)


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Annotation] | None = Field(None, max_length=MAX_ANNOTATIONS)
    logprobs: list[Logprob] | None = Field(None, max_length=4096)


class ImagePart(Strict):
    """An image in a message: by URL (a data URL, or http(s), which the ingress fetches
    where the config allows). By file_id (the Files API) is not served."""

    type: Literal["input_image"]
    image_url: str | None = None  # a data URL's size is bounded by the request's
    file_id: str | None = Field(None, max_length=256)
    detail: Literal["low", "high", "auto", "original"] | None = None

    def chat_part(self) -> dict[str, Any]:
        if self.image_url is None:
            raise InvalidRequestError(
                f"input_image by file_id {NOT_SUPPORTED}: send image_url (a data URL or "
                "an http(s) URL)",
                "input",
            )
        return image_url_part(self.image_url, "input")


def _parts_of(kinds: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        """Parts of `kinds` only: another kind of part is named in the 400."""
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in kinds:
                    raise ValueError(f"content parts of type {kind!r} {NOT_SUPPORTED}")
        return value

    return check


_text_parts = _parts_of(TEXT_PARTS)


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: (
        str
        | Annotated[
            list[Annotated[TextPart | ImagePart, Field(discriminator="type")]],
            Field(max_length=MAX_PARTS),
        ]
    )
    id: str | None = Field(None, max_length=128)
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    _parts = field_validator("content", mode="before")(_parts_of((*TEXT_PARTS, "input_image")))

    @model_validator(mode="after")
    def _images_from_users(self) -> "MessageItem":
        # OpenAI's: an image is input; an assistant's (or system's) turn is text.
        parts = [] if isinstance(self.content, str) else self.content
        if self.role != "user" and any(isinstance(part, ImagePart) for part in parts):
            raise ValueError("input_image parts belong to user messages")
        return self

    def message(self) -> dict[str, Any]:
        """The chat turn's message: its text, or its parts where it holds images."""
        role = "system" if self.role == "developer" else self.role
        content = self.content
        if isinstance(content, str):
            return {"role": role, "content": content}
        if not any(isinstance(part, ImagePart) for part in content):
            return {"role": role, "content": "".join(p.text for p in content)}  # type: ignore[union-attr]
        parts = [
            p.chat_part() if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in content
        ]
        return {"role": role, "content": parts}


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(max_length=128)
    name: str = Field(max_length=256)
    arguments: str
    id: str | None = Field(None, max_length=128)
    status: Status | None = None

    def call(self, where: str) -> dict[str, Any]:
        try:
            arguments = json.loads(self.arguments)
        except (ValueError, RecursionError) as exc:  # nesting past the parser's depth too
            raise InvalidRequestError(
                f"{where}: arguments are not valid JSON ({exc})", "input"
            ) from exc
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.call_id, "type": "function", "function": function}


class OutputTextPart(Strict):
    type: Literal["input_text"]
    text: str


class FunctionOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=128)
    output: str | Annotated[list[OutputTextPart], Field(max_length=MAX_PARTS)]
    id: str | None = Field(None, max_length=128)
    status: Status | None = None

    _parts = field_validator("output", mode="before")(_text_parts)

    def message(self) -> dict[str, Any]:
        output = self.output
        if not isinstance(output, str):
            output = "".join(part.text for part in output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": output}


class ReasoningPart(Strict):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier turn's thinking: its reasoning_text parts, else its summary's."""

    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=128)
    summary: list[ReasoningPart] = Field(default_factory=list, max_length=MAX_PARTS)
    content: list[ReasoningPart] | None = Field(None, max_length=MAX_PARTS)
    encrypted_content: None = None  # another server's sealed thinking: nothing to open here
    status: Status | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem
ITEMS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionOutputItem,
    "reasoning": ReasoningItem,
}


def input_items(value: list[Any]) -> list[InputItem]:
    """The input items, each checked against its type's fields (400 in OpenAI's shape)."""
    if len(value) > MAX_INPUT_ITEMS:
        raise InvalidRequestError(
            f"input holds at most {MAX_INPUT_ITEMS} items, not {len(value)}", "input"
        )
    items = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"input[{i}] is not an item (an object)", "input")
        kind = raw.get("type", "message")
        model = ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise InvalidRequestError(
                f"input[{i}]: items of type {kind!r} {NOT_SUPPORTED}", "input"
            )
        try:
            items.append(model.model_validate(raw))
        except ValidationError as exc:
            raise InvalidRequestError(f"input[{i}]: {_words(exc)}", "input") from None
    return items


def _words(exc: ValidationError) -> str:
    # The deepest error says most (a union's other branches fail at its top).
    err = max(exc.errors(), key=lambda e: len(e["loc"]))
    branch = lambda p: isinstance(p, str) and (p == "str" or p.startswith("list["))  # noqa: E731
    where = ".".join(str(p) for p in err["loc"] if not branch(p))
    if err["type"] == "extra_forbidden":
        return f"unknown field {where!r}"
    words = err["msg"].removeprefix("Value error, ")
    return f"{where}: {words}" if where else words
