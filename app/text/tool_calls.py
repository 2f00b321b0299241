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

The parser is a pure function of the text so far (as vLLM's are), so streaming is a diff
of successive parses: a call's name appears once known, its arguments as a prefix that
only grows, and text that may still turn into a call (`<tool_`) is held back.
"""

import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


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
    fmt = ToolFormat(fmt)
    if fmt is ToolFormat.HERMES:
        return _parse_hermes(text, final)
    if fmt is ToolFormat.LLAMA3_JSON:
        return _parse_llama3(text, final)
    return _parse_mistral(text, final)


# ---- hermes ------------------------------------------------------------------------------
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _parse_hermes(text: str, final: bool) -> ParsedOutput:
    start = text.find(_OPEN)
    if start < 0:
        return ParsedOutput(text if final else _hold_back(text, _OPEN))
    out = ParsedOutput(text[:start])
    pos = start
    while pos >= 0:
        body_start = pos + len(_OPEN)
        end = text.find(_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        call = _json_call(body, "arguments", complete=end >= 0 or final)
        if call is not None:
            out.calls.append(call)
        if end < 0:
            break
        pos = text.find(_OPEN, end)
    return out


# ---- llama 3 JSON ------------------------------------------------------------------------
_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3(text: str, final: bool) -> ParsedOutput:
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        if not final and (_PYTHON_TAG.startswith(body) or not body):
            return ParsedOutput("")
        return ParsedOutput(text)
    out = ParsedOutput("")
    for piece in _split_top_level(body, ";"):
        key = "parameters" if '"parameters"' in piece else "arguments"
        done = final or _json_end(piece) is not None
        call = _json_call(piece, key, complete=done)
        if call is None:
            if final:  # JSON that is no call: it was the answer
                return ParsedOutput(text)
            continue
        out.calls.append(call)
    return out


# ---- mistral -----------------------------------------------------------------------------
_MISTRAL = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


def _parse_mistral(text: str, final: bool) -> ParsedOutput:
    start = text.find(_MISTRAL)
    if start < 0:
        return ParsedOutput(text if final else _hold_back(text, _MISTRAL))
    out = ParsedOutput(text[:start])
    rest = text[start + len(_MISTRAL) :].lstrip()
    if rest.startswith("["):  # a JSON list of calls
        items = _list_items(rest)
        for i, item in enumerate(items):
            done = final or i < len(items) - 1 or _json_end(item) is not None
            call = _json_call(item, "arguments", complete=done)
            if call is not None:
                out.calls.append(call)
        return out
    for chunk in rest.split(_MISTRAL):  # name[ARGS]{...}, repeated
        name, sep, args = chunk.partition(_ARGS)
        if not sep:
            if final and name.strip():
                out.calls.append(ParsedCall(name.strip(), "{}", True))
            continue
        end = _json_end(args.lstrip())
        arguments = args.lstrip() if end is None else args.lstrip()[:end]
        out.calls.append(ParsedCall(name.strip(), arguments, final or end is not None))
    return out


# ---- shared pieces -----------------------------------------------------------------------
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _json_call(body: str, args_key: str, complete: bool) -> ParsedCall | None:
    """A call from `{"name": ..., "<args_key>": {...}}` so far; None before its name."""
    name = _NAME.search(body)
    if name is None:
        return None
    call = ParsedCall(json.loads(f'"{name.group(1)}"'))
    found = re.search(rf'"{args_key}"\s*:\s*', body)
    if found is None:
        if complete:
            call.arguments, call.complete = "{}", True
        return call
    args = body[found.end() :]
    end = _json_end(args)
    if end is not None:
        call.arguments, call.complete = args[:end], True
    else:
        call.arguments = args.rstrip()
        call.complete = complete
    return call


def _json_end(text: str) -> int | None:
    """Where the JSON value that `text` starts with ends (just past it), or None if it
    does not end in `text`."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and ch in ",}\n" and i:
            return i  # a bare number, true, false or null
    return None


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` cut at `sep` between top-level JSON values."""
    pieces, rest = [], text
    while rest:
        end = _json_end(rest)
        if end is None:
            pieces.append(rest)
            break
        pieces.append(rest[:end])
        rest = rest[end:].lstrip()
        if not rest.startswith(sep):
            break
        rest = rest[len(sep) :].lstrip()
    return pieces


def _list_items(text: str) -> list[str]:
    """The items of the JSON list that `text` starts with, the last one maybe partial."""
    items, rest = [], text[1:].lstrip()
    while rest and not rest.startswith("]"):
        end = _json_end(rest)
        if end is None:
            items.append(rest)
            break
        items.append(rest[:end])
        rest = rest[end:].lstrip().removeprefix(",").lstrip()
    return items


def _hold_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


# ---- forcing a call ----------------------------------------------------------------------
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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
        text = r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_.*)/"
        start = f"start: TEXT | TEXT? {calls}" if optional else f"start: {calls}"
    elif fmt is ToolFormat.LLAMA3_JSON:
        call = "call: body"
        calls = 'call ("; " call)*' if parallel else "call"
        text = r"TEXT: /(?s:[^{\s<].*)/"  # an output that opens with { is a call
        start = f"start: TEXT | {calls}" if optional else f"start: {calls}"
    else:
        call = "call: body"
        more = '(", " call)*' if parallel else ""
        calls = f'"[TOOL_CALLS] [" call {more} "]"'
        text = r"TEXT: /(?s:.+)/ & ~/(?s:.*\[TOOL_CALLS.*)/"
        start = f"start: TEXT | TEXT? {calls}" if optional else f"start: {calls}"
    lines = [start, call, f"body: %json {body}"]
    if optional:
        lines.append(text)
    return "\n".join(lines) + "\n"
