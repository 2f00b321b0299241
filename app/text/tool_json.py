"""The JSON pieces a tool call is made of, read as the text grows, each character once:
where a value ends (`ValueEnd`), a call's object with its name and arguments
(`CallObject`), and a call as read so far (`CallState`). The readers in tool_parse.py
put them together in each family's syntax."""

import json
from dataclasses import dataclass

SPACE = " \t\r\n"


def skip_space(text: str, i: int, limit: int) -> int:
    while i < limit and text[i] in SPACE:
        i += 1
    return i


def held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ValueEnd:
    """Where the JSON value that starts at `start` ends (just past it), as the text
    grows. A bare number, true, false or null ends at the first `,`, `}` or newline."""

    __slots__ = ("start", "pos", "depth", "in_string", "escaped", "end", "last")

    def __init__(self, start: int) -> None:
        self.start = self.pos = self.last = start  # last: just past its last non-space
        self.depth, self.in_string, self.escaped = 0, False, False
        self.end: int | None = None

    def scan(self, text: str, limit: int) -> int | None:
        i, depth, in_string, escaped = self.pos, self.depth, self.in_string, self.escaped
        while self.end is None and i < limit:
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if depth == 0:
                        self.end = i + 1
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i + 1
            elif depth == 0 and ch in ",}\n" and i > self.start:
                self.end = i  # a bare value ends before this character
                break
            if ch not in SPACE:
                self.last = i + 1
            i += 1
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return self.end


class CallObject:
    """A call's JSON object, `{"name": "f", "<key>": {...}}` with its keys in any order,
    read as the text grows: its name once whole; its arguments' value (`args`) from its
    first character. Anything that is not such an object stops the reading."""

    def __init__(self, start: int, keys: tuple[str, ...]) -> None:
        self.pos, self.keys, self.state = start, keys, "open"
        self.item: ValueEnd | None = None  # the key or value being read
        self.key: str | None = None
        self.name: str | None = None
        self.args: ValueEnd | None = None
        self.args_named = False  # the arguments' key and colon were read

    def scan(self, text: str, limit: int) -> None:
        while self.pos < limit and self.state != "stop":
            if self.item is not None:
                end = self.item.scan(text, limit)
                if end is None:
                    return
                self._took(text[self.item.start : end])
                self.pos, self.item = end, None
                continue
            ch = text[self.pos]
            if ch in SPACE:
                self.pos += 1
                continue
            self.state = self._step(ch)
            if self.item is None:
                self.pos += 1

    def _step(self, ch: str) -> str:
        state = self.state
        if state == "open":
            return "key" if ch == "{" else "stop"
        if state == "key" and ch == '"':
            self.item = ValueEnd(self.pos)
            return "key_read"
        if state == "colon" and ch == ":":
            self.args_named = self.args_named or (self.key in self.keys and self.args is None)
            return "value"
        if state == "value":
            self.item = ValueEnd(self.pos)
            if self.key in self.keys and self.args is None:
                self.args = self.item
            return "value_read"
        if state == "after" and ch == ",":
            return "key"
        return "stop"  # the object's end, or what no call object has

    def _took(self, token: str) -> None:
        if self.state == "key_read":
            self.key, self.state = _string(token), "colon"
        else:
            if self.key == "name" and self.name is None and token.startswith('"'):
                self.name = _string(token)
            self.state = "after"


def _string(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class CallState:
    """A call as read so far: its arguments are text[start:end], or `literal`."""

    name: str | None = None
    start: int = 0
    end: int = 0
    literal: str | None = None
    complete: bool = False

    def arguments(self, text: str) -> str:
        return self.literal if self.literal is not None else text[self.start : self.end]

    def settle(self, obj: CallObject, done: bool) -> None:
        """Take what `obj` holds; `done`: its text is all there will be."""
        self.name, args = obj.name, obj.args
        if args is not None and args.end is not None:
            self.start, self.end, self.complete = args.start, args.end, True
        elif args is not None:
            self.start, self.end, self.complete = args.start, args.last, done
        elif obj.args_named:
            self.complete = done  # `"arguments":` and no value yet: arguments ""
        elif done:
            self.literal, self.complete = "{}", True
