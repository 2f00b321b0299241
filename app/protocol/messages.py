"""Typed messages that cross the ingress -> model replica hop (never HTTP objects)."""

from dataclasses import dataclass
from enum import StrEnum

from app.protocol.outputs import EngineErrorMessage
from app.protocol.sampling import SamplingParams

__all__ = ["ContextOp", "EngineErrorMessage", "GenerateRequest", "Primitive"]


class Primitive(StrEnum):
    FILL = "fill"
    GENERATE = "generate"


@dataclass(frozen=True)
class ContextOp:
    """What a request does to a context; travels with the request."""

    context_id: str
    primitive: Primitive
    parent_context_id: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]  # with `context`: the tokens to add to it
    params: SamplingParams
    context: ContextOp | None = None
