"""Typed messages that cross the ingress -> model replica hop (never HTTP objects)."""

from dataclasses import dataclass

from app.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class EngineErrorMessage:
    """A request the engine refused or could not finish; the ingress maps it to the
    dialect's error format (before the first token) or to an error event (mid-stream)."""

    status_code: int
    error_type: str
    message: str
    param: str | None = None
