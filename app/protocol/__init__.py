"""Neutral types shared by the engine and every API dialect: sampling parameters, engine
requests and their outputs, errors. No dialect's schema lives here (deployments/api)."""

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
