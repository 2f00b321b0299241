"""One output's tool calls as they stream: each piece of text in, the content and call
fragments to send out. Every dialect that streams calls uses it (OpenAI sends fragments,
Ollama whole calls)."""

import uuid
from dataclasses import dataclass

from app.text.tool_calls import ParsedCall, ToolFormat, parse


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallFragment:
    """A piece of call `index`: its first piece has `id` and `name`."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolCallStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.ids: list[str] = []  # of the calls whose name was sent
        self._content_sent = 0
        self._args_sent: list[int] = []
        self.calls: list[ParsedCall] = []  # the last parse's

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[CallFragment]]:
        """The content and call fragments that `piece` (the next text) makes safe to send;
        `final`: the output ended with it."""
        self.text += piece
        parsed = parse(self.fmt, self.text, final)
        content = ""
        if len(parsed.content) > self._content_sent and not self.ids:
            content = parsed.content[self._content_sent :]
            self._content_sent = len(parsed.content)
        fragments = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                continue
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self._args_sent.append(0)
                fragments.append(CallFragment(index, "", self.ids[index], call.name))
            new = call.arguments[self._args_sent[index] :]
            if new:
                self._args_sent[index] = len(call.arguments)
                fragments.append(CallFragment(index, new))
        self.calls = parsed.calls
        return content, fragments

    def complete_calls(self) -> list[tuple[str, ParsedCall]]:
        """(id, call) of every call whose text is whole, in order."""
        return [
            (self.ids[i], call)
            for i, call in enumerate(self.calls)
            if call.complete and i < len(self.ids)
        ]


def whole_output(fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, ParsedCall]]]:
    """A finished output's content (None when it is only calls) and its calls with ids;
    text without a readable call is all content."""
    parsed = parse(fmt, text, final=True)
    calls = [c for c in parsed.calls if c.name]
    if not calls:
        return text, []
    return parsed.content.strip() or None, [(new_call_id(), c) for c in calls]
