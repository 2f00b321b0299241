"""One output's tool calls as they stream: each piece of text in, the content and call
fragments to send out. Every dialect that streams calls uses it (OpenAI sends fragments,
Ollama whole calls)."""

import uuid
from dataclasses import dataclass

from app.text.tool_calls import ParsedCall, ToolCallParser, ToolFormat, parse


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
    """The content and call fragments of one output as it streams. Each piece costs what
    it adds: the parser reads only the new text, and only calls not yet whole and sent
    are looked at again."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.parser = ToolCallParser(fmt)
        self.ids: list[str] = []  # of the calls whose name was sent
        self._content_sent = 0
        self._args_sent: list[int] = []  # characters of each call's arguments sent
        self._settled = 0  # calls before this one are whole and wholly sent
        self._whole: list[tuple[str, ParsedCall]] = []

    @property
    def text(self) -> str:
        return self.parser.text

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[CallFragment]]:
        """The content and call fragments that `piece` (the next text) makes safe to send;
        `final`: the output ended with it."""
        parser = self.parser
        parser.feed(piece, final)
        text, content = parser.text, ""
        end = parser.content_end
        if end > self._content_sent and not self.ids:
            content = text[self._content_sent : end]
            self._content_sent = end
        calls = parser.calls
        fragments = []
        for index in range(self._settled, len(calls)):
            call = calls[index]
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self._args_sent.append(0)
                fragments.append(CallFragment(index, "", self.ids[index], call.name))
            sent = self._args_sent[index]
            if call.literal is not None:
                new = call.literal[sent:]
            else:
                new = text[call.start + sent : call.end] if call.end > call.start + sent else ""
            if new:
                self._args_sent[index] = sent + len(new)
                fragments.append(CallFragment(index, new))
            if call.complete and index == self._settled:
                self._settled += 1
                self._whole.append(
                    (self.ids[index], ParsedCall(call.name, call.arguments(text), True))
                )
        return content, fragments

    def complete_calls(self) -> list[tuple[str, ParsedCall]]:
        """(id, call) of every call whose text is whole, in order."""
        return list(self._whole)


def whole_output(fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, ParsedCall]]]:
    """A finished output's content (None when it is only calls) and its calls with ids;
    text without a readable call is all content."""
    parsed = parse(fmt, text, final=True)
    calls = [c for c in parsed.calls if c.name]
    if not calls:
        return text, []
    return parsed.content.strip() or None, [(new_call_id(), c) for c in calls]
