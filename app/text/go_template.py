"""Render the subset of Go's text/template that Ollama `template` fields use in practice.

Supported: text; field actions `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}` (and any
other key the caller passes in `values`); `{{ if .X }}`, `{{ else if .Y }}`, `{{ else }}`,
`{{ end }}`, nested; comments `{{/* ... */}}`; trim markers `{{- ` and ` -}}`, which, as in
Go, remove all whitespace (space, tab, CR, LF) of the template text on that side. A field is
true in an `if` when its value is a non-empty string. Everything else (range, with,
template, define, functions, pipelines, variables, literals, unbalanced blocks, unterminated
actions, unknown fields) raises TemplateError, a ValueError, saying what and where: a
template either renders as Go would render it or is refused, never rendered differently.

Invariants, and why:
- Values are inserted literally and never scanned: a prompt holding `C:\\Users`, `\\1` or
  `{{` comes out exactly as it went in (the regex renderer this replaces fed the prompt to
  re.sub as a replacement string, and a backslash in it was a 500).
- Linear time, no regular expressions: the template is scanned once with str.find for
  `{{`, `}}` and `*/`, each action is tokenized by hand, and `if` blocks are evaluated with
  an explicit stack (no recursion, so deep nesting cannot overflow), in the same pass.
  Templates are capped at MAX_TEMPLATE_BYTES.
"""

from dataclasses import dataclass

MAX_TEMPLATE_BYTES = 65536
KNOWN_FIELDS = frozenset({"System", "Prompt", "Response"})

_SPACE = " \t\r\n"  # Go's spaceChars: what trim markers remove and what separates tokens
_UNSUPPORTED_KEYWORDS = frozenset(
    {"range", "with", "template", "define", "block", "break", "continue"}
)
_LITERALS = {'"': "string", "`": "raw string", "'": "character"}


class TemplateError(ValueError):
    """The template is not in the supported subset or is malformed (a client error)."""


@dataclass
class _Block:
    """One open `if`: where it opened, whether its enclosing text renders, whether a
    branch has been chosen already, and whether `{{ else }}` was seen."""

    at: int
    outer: bool
    taken: bool
    seen_else: bool = False


def render(template: str, values: dict[str, str], max_chars: int = 1 << 21) -> str:
    """Renders `template` with `values` (field name -> text); raises TemplateError, also
    when the result would pass `max_chars` (a field repeated many times would else turn
    one small request into gigabytes)."""
    if len(template) > MAX_TEMPLATE_BYTES or len(template.encode()) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"the template is larger than {MAX_TEMPLATE_BYTES} bytes")
    parts: list[str] = []
    size = 0
    blocks: list[_Block] = []
    emit = True  # whether the current position renders (all enclosing branches taken)
    pos = 0
    trim_next = False  # the previous action ended with ` -}}`
    while True:
        open_at = template.find("{{", pos)
        end = len(template) if open_at < 0 else open_at
        inner_at = end + 2
        trim_prev = open_at >= 0 and _trim_marker_after(template, inner_at)
        if emit:
            text = template[pos:end]
            if trim_next:
                text = text.lstrip(_SPACE)
            if trim_prev:
                text = text.rstrip(_SPACE)
            parts.append(text)
        if open_at < 0:
            break
        if trim_prev:
            inner_at += 2
        inner, pos, trim_next = _action_at(template, open_at, inner_at)
        if inner is None:  # a comment
            continue
        kind, field = _parse(inner, template, open_at, values)
        if kind == "field":
            if emit:
                value = values.get(field) or ""
                size += len(value)
                if size > max_chars:
                    raise _error(
                        template, open_at, f"the rendered prompt passes {max_chars} characters"
                    )
                parts.append(value)
        elif kind == "if":
            blocks.append(_Block(open_at, emit, _truthy(values, field)))
            emit = emit and blocks[-1].taken
        elif kind in ("else", "elseif"):
            if not blocks:
                raise _error(template, open_at, "{{ else }} without a matching {{ if }}")
            if blocks[-1].seen_else:
                raise _error(template, open_at, "{{ else }} after {{ else }}: expected {{ end }}")
            block = blocks[-1]
            taken = kind == "else" or _truthy(values, field)
            emit = block.outer and taken and not block.taken
            block.taken = block.taken or taken
            block.seen_else = kind == "else"
        else:  # end
            if not blocks:
                raise _error(template, open_at, "{{ end }} without a matching {{ if }}")
            emit = blocks.pop().outer
    if blocks:
        raise _error(template, blocks[-1].at, "{{ if }} is never closed by {{ end }}")
    return "".join(parts)


def _truthy(values: dict[str, str], field: str) -> bool:
    return bool(values.get(field))


def _trim_marker_after(template: str, i: int) -> bool:
    """`{{- ` trims: a dash then a space (`{{-3}}` would be the number -3 in Go)."""
    return template.startswith("-", i) and i + 1 < len(template) and template[i + 1] in _SPACE


def _action_at(template: str, open_at: int, inner_at: int) -> tuple[str | None, int, bool]:
    """(the action's text or None for a comment, where the text after it starts, whether
    it ends with a trim marker) for the action opened at open_at."""
    if template.startswith("/*", inner_at):
        # Go: the comment must end right before the closing delimiter.
        close = template.find("*/", inner_at + 2)
        if close < 0:
            raise _error(template, open_at, "unclosed comment")
        after = close + 2
        if template.startswith("}}", after):
            return None, after + 2, False
        if template.startswith("-}}", after + 1) and template[after] in _SPACE:
            return None, after + 4, True
        raise _error(template, open_at, "comment ends before the closing }}")
    close = template.find("}}", inner_at)
    if close < 0:
        raise _error(template, open_at, "unterminated action: no closing }}")
    # ` -}}`: a space then a dash, right before the delimiter.
    if close - 2 >= inner_at and template[close - 1] == "-" and template[close - 2] in _SPACE:
        return template[inner_at : close - 2], close + 2, True
    return template[inner_at:close], close + 2, False


def _parse(inner: str, template: str, at: int, values: dict[str, str]) -> tuple[str, str]:
    """Classifies an action's text as ("field", name), ("if", name), ("elseif", name),
    ("else", "") or ("end", "")."""
    words = inner.split(maxsplit=1)
    if words and words[0] in _UNSUPPORTED_KEYWORDS:  # before its arguments are lexed
        raise _error(template, at, f"{{{{ {words[0]} }}}} is not supported")
    tokens = _tokens(inner, template, at)
    if not tokens:
        raise _error(template, at, "empty action")
    head = tokens[0]
    if head.startswith("."):
        if len(tokens) > 1:
            raise _error(template, at, f"arguments or pipelines after {head} are not supported")
        return "field", _field(head, template, at, values)
    if head in ("if", "else", "end"):
        shape = " ".join("." if t.startswith(".") else t for t in tokens)
        forms = {"if .": "if", "else if .": "elseif", "else": "else", "end": "end"}
        if shape not in forms:
            raise _error(
                template,
                at,
                f"{{{{ {inner.strip()} }}}} is not supported: only {{{{ if .Field }}}}, "
                "{{ else if .Field }}, {{ else }} and {{ end }} are",
            )
        field = _field(tokens[-1], template, at, values) if tokens[-1].startswith(".") else ""
        return forms[shape], field
    raise _error(template, at, f"function calls ({head}) are not supported")


def _field(token: str, template: str, at: int, values: dict[str, str]) -> str:
    name = token[1:]
    if not name:
        raise _error(template, at, "{{ . }} (the whole data) is not supported")
    if "." in name:
        raise _error(template, at, f"nested field {token} is not supported")
    if name not in KNOWN_FIELDS and name not in values:
        known = ", ".join(f".{f}" for f in sorted(KNOWN_FIELDS | values.keys()))
        raise _error(template, at, f"unknown field {token} (known: {known})")
    return name


def _tokens(inner: str, template: str, at: int) -> list[str]:
    """Splits an action into words (`if`, `len`) and fields (`.System`, `.A.B`, `.`);
    raises on anything else, naming it."""
    tokens: list[str] = []
    i, n = 0, len(inner)
    while i < n:
        ch = inner[i]
        if ch in _SPACE:
            i += 1
            continue
        start = i
        if ch == "." or ch.isalpha() or ch == "_":
            i += 1
            while i < n and (inner[i].isalnum() or inner[i] in "._"):
                # A word ends at a dot (`if.System` is `if` then `.System`, as in Go).
                if inner[i] == "." and inner[start] != ".":
                    break
                i += 1
            tokens.append(inner[start:i])
            continue
        raise _error(template, at, f"{_describe(ch)} in an action is not supported")
    return tokens


def _describe(ch: str) -> str:
    if ch == "|":
        return "a pipeline (|)"
    if ch == "$":
        return "a variable ($)"
    if ch in "()":
        return "a parenthesized pipeline"
    if ch in _LITERALS:
        return f"a {_LITERALS[ch]} literal"
    if ch.isdigit() or ch in "-+":
        return "a number"
    return f"the character {ch!r}"


def _error(template: str, at: int, problem: str) -> TemplateError:
    """`problem`, located as line:column (1-based) of the action's `{{`."""
    line = template.count("\n", 0, at) + 1
    column = at - (template.rfind("\n", 0, at) + 1) + 1
    return TemplateError(f"template line {line}, column {column}: {problem}")
