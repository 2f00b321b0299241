"""Tool calls in a model's output: each family's syntax, a parser that reads calls out of
the text so far (streamed or whole), and the grammar that forces a call when the client
requires one.

Formats (what the model writes):
- hermes (Hermes, Qwen 2.5/3, and Shoal's ChatML tools template for SmolLM2):
  `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call;
- llama3_json (Llama 3.1-3.3): the whole output is `{"name": "f", "parameters": {...}}`,
  after an optional `<|python_tag|>`, several calls joined by `;`;
- mistral: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]` (v0.3 tokenizers), or
  `[TOOL_CALLS]f[ARGS]{...}` (v11 and later).

The parser (tool_parse.py) reads a streamed output as it grows, each character once, and
gives what a parse of the whole text so far gives: a call's name once known, its arguments
as a prefix that only grows, and text that may still turn into a call (`<tool_`) held
back.
"""

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from app.text.tool_parse import CallState, HermesReader, Llama3Reader, MistralReader, Reader


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


@dataclass
class ParsedCall:
    name: str | None = None
    arguments: str = ""  # JSON text so far; whole once `complete`
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str  # text outside calls that is safe to show now
    calls: list[ParsedCall] = field(default_factory=list)


def tool_format(chat_template: str | None) -> ToolFormat:
    """The syntax a chat template teaches its model (hermes when it does not say)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


def parse(fmt: ToolFormat, text: str, final: bool) -> ParsedOutput:
    """The calls in `text` (the output so far; `final`: the whole output)."""
    parser = ToolCallParser(fmt)
    parser.feed(text, final)
    return parser.output()


class ToolCallParser:
    """The calls in an output that grows by pieces, each character read once
    (tool_parse.py); `parse` is one feed of the whole text."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.text = ""
        self.reader: Reader = READERS[ToolFormat(fmt)]()

    def feed(self, piece: str, final: bool = False) -> None:
        self.text += piece
        self.reader.feed(self.text, final)

    @property
    def content_end(self) -> int:
        """How much of the text is content that is safe to show now."""
        return self.reader.content_end

    @property
    def calls(self) -> list[CallState]:
        """The calls read so far (their names once known), in order."""
        return [c for c in self.reader.calls if c.name] if not self.reader.all_content else []

    def output(self) -> ParsedOutput:
        calls = [ParsedCall(c.name, c.arguments(self.text), c.complete) for c in self.calls]
        return ParsedOutput(self.text[: self.content_end], calls)


READERS: dict[ToolFormat, type[Reader]] = {
    ToolFormat.HERMES: HermesReader,
    ToolFormat.LLAMA3_JSON: Llama3Reader,
    ToolFormat.MISTRAL: MistralReader,
}


# ---- forcing a call ----------------------------------------------------------------------
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Text that is not a call: it never holds (or, for Llama 3's bare JSON, opens with) a
# call's marker, so a call the model starts is always read as one.
TEXT = {
    ToolFormat.HERMES: r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_.*)/",
    ToolFormat.LLAMA3_JSON: r"TEXT: /(?s:[^{\s<].*)/",  # an output that opens with { is a call
    ToolFormat.MISTRAL: r"TEXT: /(?s:.+)/ & ~/(?s:.*\[TOOL_CALLS.*)/",
}


def call_grammar(
    fmt: ToolFormat, functions: list[dict[str, Any]], parallel: bool, optional: bool = False
) -> str:
    """A Lark grammar (llguidance's, with %json) for the calls of `functions` (OpenAI's
    {name, parameters}) in `fmt`: one call, or with `parallel` one or more. `optional`
    (tool_choice auto): text may come instead, or before the calls; text cannot start a
    call's marker, so a call the model starts is always well-formed."""
    fmt = ToolFormat(fmt)
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                key: f.get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    body = json.dumps({"anyOf": options, "x-guidance": JSON_STYLE})
    if fmt is ToolFormat.HERMES:
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        calls = 'call ("\\n" call)*' if parallel else "call"
        start = f"start: TEXT | TEXT? {calls}" if optional else f"start: {calls}"
    elif fmt is ToolFormat.LLAMA3_JSON:
        call = "call: body"
        calls = 'call ("; " call)*' if parallel else "call"
        start = f"start: TEXT | {calls}" if optional else f"start: {calls}"
    else:
        call = "call: body"
        more = '(", " call)*' if parallel else ""
        calls = f'"[TOOL_CALLS] [" call {more} "]"'
        start = f"start: TEXT | TEXT? {calls}" if optional else f"start: {calls}"
    lines = [start, call, f"body: %json {body}"]
    if optional:
        lines.append(TEXT[fmt])
    return "\n".join(lines) + "\n"


def text_grammar(fmt: ToolFormat) -> str:
    """A Lark grammar for an answer with no call in `fmt` (tool_choice none while the
    tools stay in the prompt, as they were for the turns before: the prompt keeps its
    prefix, and the conversation's cached KV with it)."""
    return f"start: TEXT\n{TEXT[ToolFormat(fmt)]}\n"
