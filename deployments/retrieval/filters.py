"""Attribute filters of a search (OpenAI's `filters`): a comparison
`{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin", "key", "value"}` or a compound
`{"type": "and"|"or", "filters": [...]}`, tested on a vector store file's `attributes`.
A filter of the wrong shape is a 400 before anything is searched."""

import operator
from typing import Any

from app.protocol.errors import InvalidRequestError

COMPARE = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
}
MAX_DEPTH = 8
SCALAR = (str, int, float, bool)


def check(spec: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH or not isinstance(spec, dict):
        raise InvalidRequestError(
            "filters: a filter is an object, nested at most 8 deep", "filters"
        )
    kind = spec.get("type")
    if not isinstance(kind, str):
        raise InvalidRequestError("filters: a filter's type is a string", "filters")
    if kind in ("and", "or"):
        parts = spec.get("filters")
        if not isinstance(parts, list) or not parts:
            raise InvalidRequestError(f"filters: '{kind}' needs a list of filters", "filters")
        for part in parts:
            check(part, depth + 1)
    elif kind in COMPARE or kind in ("in", "nin"):
        if not isinstance(spec.get("key"), str) or "value" not in spec:
            raise InvalidRequestError(f"filters: '{kind}' needs a key and a value", "filters")
        value = spec["value"]
        if kind in ("in", "nin"):
            if not isinstance(value, list) or not all(isinstance(v, SCALAR) for v in value):
                raise InvalidRequestError(f"filters: '{kind}' needs a list of values", "filters")
        elif not isinstance(value, SCALAR):
            raise InvalidRequestError(
                f"filters: '{kind}' compares with a string, number or boolean", "filters"
            )
    else:
        raise InvalidRequestError(f"filters: unknown filter type {kind!r}", "filters")


def matches(spec: dict, attributes: dict) -> bool:
    kind = spec["type"]
    if kind == "and":
        return all(matches(p, attributes) for p in spec["filters"])
    if kind == "or":
        return any(matches(p, attributes) for p in spec["filters"])
    if spec["key"] not in attributes:
        return kind in ("ne", "nin")
    have, want = attributes[spec["key"]], spec["value"]
    if kind == "in":
        return have in want
    if kind == "nin":
        return have not in want
    try:
        return bool(COMPARE[kind](have, want))
    except TypeError:  # a string against a number: no match, as no order holds
        return False
