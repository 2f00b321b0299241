"""What the engine hands back: token deltas while streaming, one result when done."""

from dataclasses import dataclass, field
from enum import StrEnum

from app.protocol.sampling import SamplingParams


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id, or (in the ingress) a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class EngineErrorMessage:
    """A request the engine refused or could not finish; the ingress maps it to the
    dialect's error format (before the first token) or to an error event (mid-stream)."""

    status_code: int
    error_type: str
    message: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one output sequence since the previous delta.

    `index` is the output's position among a request's `n` outputs. The last delta
    of an output carries its `finish_reason`; earlier ones carry None. A delta with an
    `error` ends the whole request (every output): the engine gave up on it alone.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: EngineErrorMessage | None = None

    def wire(self) -> "WireDelta":
        """This delta as it crosses the model replica -> ingress hop: plain tuples, ints
        and strings, which Ray serializes with msgpack. A dataclass goes through
        cloudpickle instead: a bare Ray stream spent ~100 us more CPU per message on
        each side with it. Without its request id (the caller knows which request it
        streams) and its error (a failed request ends with an EngineErrorMessage)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = tuple((lp.token_id, lp.logprob, lp.top) for lp in self.logprobs)
        reason = None if self.finish_reason is None else self.finish_reason.value
        return (
            self.index,
            self.token_ids,
            reason,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            logprobs,
        )

    @classmethod
    def from_wire(cls, request_id: str, wire: "WireDelta") -> "TokenDelta":
        index, token_ids, reason, prompt, cached, logprobs = wire
        if logprobs is not None:
            logprobs = tuple(TokenLogprob(i, lp, top) for i, lp, top in logprobs)
        finish = None if reason is None else FinishReason(reason)
        return cls(request_id, index, token_ids, logprobs, finish, prompt, cached)


# TokenDelta.wire(): (index, token_ids, finish_reason, num_prompt_tokens,
# num_cached_tokens, logprobs as (token_id, logprob, top) tuples).
WireDelta = tuple[int, tuple[int, ...], str | None, int, int, tuple | None]


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's `n` outputs, complete."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestOutput:
    """Everything an offline `generate` call produced for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine reports once it has loaded its model."""

    model: str
    max_model_len: int
    reads_images: bool = False  # the model has an image encoder (app/models/vision)


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One of an engine's `max_num_seqs` seats: each running or waiting request holds one
    (in admission order), the rest are idle. llama.cpp calls them slots."""

    index: int
    state: str  # "idle", "running" or "waiting"
    max_model_len: int
    request_id: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    params: SamplingParams | None = None


@dataclass(frozen=True, slots=True)
class ContextFile:
    """A context written to, or read from, a file."""

    num_tokens: int
    num_bytes: int
