"""Readers of tool calls in a growing output, one per family's syntax, each character
scanned once: a streamed output costs what the whole one costs (re-parsing the text so
far on every piece made a long call quadratic: 8,000 argument pieces took seconds).

A reader is fed the whole text so far (`text`, which only grows) and resumes where it
stopped. Text that may still turn into a marker (`<tool_`, `</tool_call`, `[TOOL_CALLS`)
is neither shown nor scanned until it is known, so what a reader shows only grows: the
content up to `content_end`, and each call's name once whole and its arguments as a
prefix that never shrinks. tool_calls.py says the syntaxes; its `parse` is one feed of
the whole text, so a streamed and a whole parse agree by construction.
"""

from dataclasses import dataclass, field

from app.text.tool_json import CallObject, CallState, ValueEnd, held, skip_space


@dataclass
class Reader:
    """What every reader keeps: the content's end and the calls read so far (a call
    without a name is no call; `parse` leaves it out)."""

    content_end: int = 0
    calls: list[CallState] = field(default_factory=list)
    all_content: bool = False  # the whole output turned out to be content

    def feed(self, text: str, final: bool) -> None:
        raise NotImplementedError


def _between(text: str, n: int, marker: str, final: bool, found: int) -> int:
    """The limit of a region that `marker` (found at `found`, or -1) ends."""
    if found >= 0:
        return found
    return n if final else n - held(text, marker)


class HermesReader(Reader):
    """`<tool_call>{...}</tool_call>`, repeated; the content is what comes before the first."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.search = 0  # where the next marker may start
        self.obj: CallObject | None = None  # the call whose close is not read yet
        self.in_calls = False

    def feed(self, text: str, final: bool) -> None:
        n = len(text)
        while True:
            if self.obj is None:
                start = text.find(self.OPEN, self.search)
                if start < 0:
                    self.search = max(self.search, n - len(self.OPEN) + 1)
                    if not self.in_calls:
                        self.content_end = n if final else n - held(text, self.OPEN)
                    return
                if not self.in_calls:
                    self.content_end, self.in_calls = start, True
                self.search = start + len(self.OPEN)
                self.obj = CallObject(self.search, ("arguments",))
                self.calls.append(CallState())
            close = text.find(self.CLOSE, self.search)
            limit = _between(text, n, self.CLOSE, final, close)
            self.obj.scan(text, limit)
            self.calls[-1].settle(self.obj, close >= 0 or final)
            if close < 0:
                self.search = max(self.search, n - len(self.CLOSE) + 1)
                return
            self.obj, self.search = None, close + len(self.CLOSE)


class Llama3Reader(Reader):
    """`{"name": "f", "parameters": {...}}`, after an optional `<|python_tag|>`, several
    joined by `;`; an output that opens with anything else is content."""

    TAG = "<|python_tag|>"
    KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.tagged, self.mode = 0, False, "lead"
        self.piece: ValueEnd | None = None  # the call being read
        self.obj: CallObject | None = None
        self.separated = False  # a `;` was read after the last call

    def feed(self, text: str, final: bool) -> None:
        n = len(text)
        if self.mode == "lead":
            self._lead(text, n, final)
        if self.mode == "content":
            self.content_end = n
        elif self.mode == "calls":
            self._calls(text, n, final)
            if final and any(c.name is None for c in self.calls):
                self.all_content, self.content_end = True, n  # JSON that is no call

    def _lead(self, text: str, n: int, final: bool) -> None:
        b = self.pos = skip_space(text, self.pos, n)
        if not self.tagged and text.startswith(self.TAG, b):
            self.tagged = True
            b = self.pos = skip_space(text, b + len(self.TAG), n)
        if b < n and text[b] == "{":
            self.mode = "calls"
        elif final or b < n and not (n - b < len(self.TAG) and self.TAG.startswith(text[b:])):
            self.mode = "content"

    def _calls(self, text: str, n: int, final: bool) -> None:
        while self.mode == "calls":
            b = self.pos = skip_space(text, self.pos, n)
            if b == n:
                return
            if self.piece is None and self.calls and not self.separated:
                self.separated = text[b] == ";"  # a call follows, or nothing more does
                self.mode = "calls" if self.separated else "done"
                self.pos = b + 1
                continue
            if self.piece is None:
                self.piece, self.obj = ValueEnd(b), CallObject(b, self.KEYS)
                self.calls.append(CallState())
                self.separated = False
            end = self.piece.scan(text, n)
            self.obj.scan(text, n if end is None else end)
            self.calls[-1].settle(self.obj, final or end is not None)
            if end is None:
                return
            self.piece, self.pos = None, end


class MistralReader(Reader):
    """`[TOOL_CALLS] [{...}, ...]` (a JSON list of calls), or `[TOOL_CALLS]f[ARGS]{...}`
    repeated; the content is what comes before the first marker."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self.search, self.pos, self.mode = 0, 0, "content"
        self.item: ValueEnd | None = None  # the list's item, or a call's arguments
        self.obj: CallObject | None = None
        self.args_at: int | None = None  # past the named call's [ARGS]
        self.args_search = 0

    def feed(self, text: str, final: bool) -> None:
        n = len(text)
        if self.mode == "content":
            start = text.find(self.MARK, self.search)
            if start < 0:
                self.search = max(self.search, n - len(self.MARK) + 1)
                self.content_end = n if final else n - held(text, self.MARK)
                return
            self.content_end, self.mode = start, "rest"
            self.pos = self.search = start + len(self.MARK)
        if self.mode == "rest":
            self.pos = skip_space(text, self.pos, n)
            if self.pos == n:
                return
            self.mode = "list" if text[self.pos] == "[" else "named"
            self.pos += self.mode == "list"
            self.search = self.args_search = self.pos
        if self.mode == "list":
            self._list(text, n, final)
        elif self.mode == "named":
            while self._named(text, n, final):
                pass
            if final:
                for call in self.calls:
                    call.complete = True

    def _list(self, text: str, n: int, final: bool) -> None:
        while True:
            if self.item is None:
                self.pos = skip_space(text, self.pos, n)
                if self.pos < n and text[self.pos] == "," and self.calls:
                    self.pos = skip_space(text, self.pos + 1, n)
                if self.pos == n:
                    return
                if text[self.pos] == "]":
                    self.mode = "done"
                    return
                self.item = ValueEnd(self.pos)
                self.obj = CallObject(self.pos, ("arguments",))
                self.calls.append(CallState())
            end = self.item.scan(text, n)
            self.obj.scan(text, n if end is None else end)
            self.calls[-1].settle(self.obj, final or end is not None)
            if end is None:
                return
            self.item, self.pos = None, end

    def _named(self, text: str, n: int, final: bool) -> bool:
        """Read on in one `name[ARGS]{...}`; whether the next one began."""
        mark = text.find(self.MARK, self.search)
        limit = _between(text, n, self.MARK, final, mark)
        if self.args_at is None:
            sep = text.find(self.ARGS, self.args_search, limit)
            self.args_search = max(self.args_search, limit - len(self.ARGS) + 1)
            if sep >= 0:
                self.calls.append(CallState(text[self.pos : sep].strip()))
                self.args_at = sep + len(self.ARGS)
            elif (mark >= 0 or final) and text[self.pos : limit].strip():
                # no arguments: a call once its text has ended
                self.calls.append(
                    CallState(text[self.pos : limit].strip(), literal="{}", complete=True)
                )
        if self.args_at is not None:
            self._arguments(text, limit, final)
        if mark < 0:
            self.search = max(self.search, n - len(self.MARK) + 1)
            return False
        self.item, self.args_at = None, None
        self.pos = self.search = self.args_search = mark + len(self.MARK)
        return True

    def _arguments(self, text: str, limit: int, final: bool) -> None:
        call = self.calls[-1]
        if self.item is None:
            self.args_at = skip_space(text, self.args_at, limit)
            if self.args_at < limit:
                self.item = ValueEnd(self.args_at)
        end = None
        if self.item is not None:
            end = self.item.scan(text, limit)
            call.start, call.end = self.item.start, end or limit
        call.complete = final or end is not None
