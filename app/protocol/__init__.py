"""Neutral request/response types shared by the engine and every API dialect."""

from app.protocol.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    ShoalError,
)
from app.protocol.outputs import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    TokenDelta,
    TokenLogprob,
)
from app.protocol.sampling import SamplingParams

__all__ = [
    "CompletionOutput",
    "ContextLengthExceededError",
    "FinishReason",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "ShoalError",
    "TokenDelta",
    "TokenLogprob",
]
