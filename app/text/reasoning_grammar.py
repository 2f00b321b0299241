"""A constraint that leaves a reasoning model free to think first.

A structured output (a JSON schema, a regex, a grammar, a tool call) constrains the
answer, not the thinking: vLLM's reading, and the only one a reasoning model survives
(a template that opens the thinking block would otherwise have the grammar's text land
in the thinking). So the request's constraint becomes a Lark grammar: a thinking block,
free text up to and including its closing marker (optional unless the prompt opened
it), blank space, then the constraint's own grammar nested whole (`%lark`, `%json`).

The block is one lexeme (text ending with the closing marker, holding no earlier one):
llguidance's lexemes are greedy, so free text followed by a separate closing literal
would swallow the marker's first bytes and never close.
"""

import json
import re

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import MAX_CONSTRAINT_CHARS, Constraint, ConstraintKind
from app.text.reasoning import ReasoningFormat
from app.text.tool_calls import JSON_STYLE


def thinking_first(fmt: ReasoningFormat, constraint: Constraint) -> Constraint:
    """`constraint`, applied to the answer after the thinking of a `fmt` output."""
    end = _rx(re.escape(fmt.end))
    block = f"(?s:.*{end})"
    if not fmt.starts_inside:
        block = _rx(re.escape(fmt.start)) + block
    lines = [
        "start: THOUGHT WS? answer" if fmt.starts_inside else "start: (THOUGHT WS?)? answer",
        f"THOUGHT: /{block}/ & ~/(?s:.*{end}.+)/",
        r"WS: /[ \t\r\n]+/",
        f"answer: {_nested(constraint)}",
    ]
    spec = "\n".join(lines) + "\n"
    if len(spec) > MAX_CONSTRAINT_CHARS:  # the request's constraint, near the limit already
        raise InvalidRequestError(
            f"the output's constraint is too large to follow the thinking ({len(spec)} "
            f"characters with it; at most {MAX_CONSTRAINT_CHARS})"
        )
    return Constraint(kind=ConstraintKind.LARK, spec=spec)


def _nested(constraint: Constraint) -> str:
    """The constraint as one Lark rule body: its own grammar, with its own lexer."""
    spec, kind = constraint.spec, constraint.kind
    if kind is ConstraintKind.JSON:
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"invalid json constraint: {exc}") from exc
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequestError("invalid json constraint: a JSON schema is an object")
        # As the engine compiles a schema alone (app/engine/grammar.py): no free space.
        return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})
    if kind is ConstraintKind.REGEX:
        body = f"start: /{_rx(spec)}/"
    elif kind is ConstraintKind.CHOICE:
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"invalid choice constraint: {exc}") from exc
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError("invalid choice constraint: a list of strings")
        body = "start: " + " | ".join(json.dumps(c) for c in choices)
    elif kind is ConstraintKind.GRAMMAR:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            body = any_to_lark(spec)
        except Exception as exc:  # the converter's own errors: the grammar is the client's
            raise InvalidRequestError(f"invalid grammar constraint: {exc}") from exc
    else:
        body = spec
    return "%lark {\n" + body + "\n}"


def _rx(pattern: str) -> str:
    """A regex as the body of a Lark `/.../` terminal: its unescaped slashes escaped."""
    out, escaped = [], False
    for ch in pattern:
        if ch == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)
