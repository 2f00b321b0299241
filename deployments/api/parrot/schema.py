"""Parrot's primitive requests (Fill / Generate on contexts) and their sampling config."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from app.protocol.sampling import MAX_SEED, SamplingParams, sampling_params
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings

# Parrot types every id as an integer: a string (even "7") is a 400, as are negative ones.
ContextId = Annotated[StrictInt, Field(ge=0, le=MAX_SEED)]


class PrimitiveRequest(BaseModel):
    """What every Parrot primitive names: its session, task and context."""

    model_config = ConfigDict(extra="forbid")

    session_id: ContextId
    task_id: ContextId
    context_id: ContextId
    parent_context_id: ContextId | None = None
    model: str | None = Field(None, description="Which served model; default: the first.")

    @model_validator(mode="after")
    def _ids(self) -> "PrimitiveRequest":
        if self.parent_context_id is not None and str(self.parent_context_id) == str(
            self.context_id
        ):
            raise ValueError("parent_context_id must differ from context_id")
        return self

    @property
    def context_key(self) -> str:
        return str(self.context_id)

    @property
    def parent_key(self) -> str | None:
        return None if self.parent_context_id is None else str(self.parent_context_id)


class FillRequest(PrimitiveRequest):
    token_ids: list[int] | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _content(self) -> "FillRequest":
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids and text")
        if not (self.token_ids or self.text):
            raise ValueError("a fill must not be empty")
        if self.token_ids and any(t < 0 for t in self.token_ids):
            raise ValueError("token ids must be non-negative")
        return self


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_gen_length: int = 128
    ignore_tokenizer_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_str: list[str] | str | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = None

    def params(self) -> SamplingParams:
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_gen_length,
            ignore_eos=self.ignore_tokenizer_eos,
            stop_token_ids=tuple(self.stop_token_ids),
            seed=self.seed,
        )
        names = {"max_tokens": "max_gen_length", "ignore_eos": "ignore_tokenizer_eos"}
        return sampling_params(fields, names, prefix="sampling_config.")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop_str is None:
            return []
        stops = [self.stop_str] if isinstance(self.stop_str, str) else list(self.stop_str)
        return check_stop_strings(stops, "sampling_config.stop_str")


class ParrotGenerateRequest(PrimitiveRequest):
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)


class FreeContextRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context_id: ContextId
    model: str | None = None
