"""SamplingParams: how to pick tokens and when to stop, validated once at the edge."""

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.protocol.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # seeds are int64 everywhere (torch, vLLM); n outputs use seed + index
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit
MAX_STOP_TOKEN_IDS = 1024
MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema or grammar's text; the compiler has its own caps


class ConstraintKind(StrEnum):
    """What a constraint's `spec` is. Every dialect maps its own fields onto these."""

    JSON = "json"  # a JSON schema, as JSON text ('{"type": "object"}': any object)
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # GBNF (llama.cpp's) or Lark
    LARK = "lark"  # Lark with llguidance's extensions (%json): tool calls


class Constraint(BaseModel):
    """The output must match this: the engine masks every token that cannot lead to a
    match, and ends the output when nothing more can follow."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ConstraintKind
    spec: str = Field(max_length=MAX_CONSTRAINT_CHARS)


class SamplingParams(BaseModel):
    """Per-request sampling settings. temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(1, ge=1, le=128, description="Independent outputs sharing the prompt's KV.")
    max_tokens: int = Field(16, ge=1, description="Most tokens to generate per output.")
    min_tokens: int = Field(0, ge=0, description="EOS and stop ids are masked until this many.")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Same seed, same output, whatever the batch."
    )
    stop_token_ids: tuple[int, ...] = Field((), max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return the chosen token's logprob and this many alternatives.",
    )
    constraint: Constraint | None = None
    lora: str | None = Field(
        None, min_length=1, max_length=256, description="The LoRA adapter to run; None: the base."
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise ValueError(f"logit_bias has a negative token id {token_id}")
            if not -100.0 <= bias <= 100.0:  # also refuses NaN
                raise ValueError(f"logit_bias for token {token_id} must be in [-100, 100]")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def sampling_params(
    fields: dict[str, Any], names: dict[str, str] | None = None, prefix: str = ""
) -> SamplingParams:
    """SamplingParams from a dialect's fields; a bad value is an InvalidRequestError whose
    `param` is the dialect's own name for it (`names`: our field -> theirs)."""
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = str(err["loc"][0]) if err["loc"] else ""
        param = prefix + (names or {}).get(loc, loc) if loc else prefix.rstrip(".") or None
        message = f"{param}: {err['msg']}" if param else err["msg"]
        raise InvalidRequestError(message, param=param) from exc
