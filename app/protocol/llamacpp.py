"""llama.cpp server request schemas (the fields with a meaning here) and their mapping
onto neutral SamplingParams."""

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import MAX_CONSTRAINT_CHARS, Constraint, SamplingParams, sampling_params
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] = Field(max_length=1_000_000)
    model: str | None = None


class SlotFileRequest(BaseModel):
    """The body of POST /slots/{id}?action=save|restore|erase."""

    model_config = ConfigDict(extra="forbid")
    filename: str | None = None
    model: str | None = None


class LlamaCompletionRequest(BaseModel):
    """/completion's fields (llama.cpp's names and defaults)."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | list[int] = ""
    n_predict: int = Field(-1, ge=-1)
    temperature: float = 0.8
    top_k: int = Field(40, ge=0)
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = -1
    model: str | None = None
    json_schema: dict[str, Any] | None = None  # the output must match it
    grammar: str | None = Field(None, max_length=MAX_CONSTRAINT_CHARS)  # GBNF, as llama.cpp's

    def constraint(self) -> Constraint | None:
        if self.json_schema is not None and self.grammar:
            raise InvalidRequestError("give json_schema or grammar, not both", "grammar")
        if self.grammar:
            return Constraint(kind="grammar", spec=self.grammar)
        if self.json_schema is not None:
            spec = json.dumps(self.json_schema)
            if len(spec) > MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError("json_schema is too large", "json_schema")
            return Constraint(kind="json", spec=spec)
        return None

    def params(self, default_max_tokens: int) -> SamplingParams:
        fields = dict(
            max_tokens=default_max_tokens if self.n_predict == -1 else max(self.n_predict, 1),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed < 0 else self.seed,
            ignore_eos=self.ignore_eos,
            constraint=self.constraint(),
        )
        names = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}
        return sampling_params(fields, names)

    @property
    def stop_strings(self) -> list[str]:
        return check_stop_strings(self.stop, "stop")


class LlamaInfillRequest(LlamaCompletionRequest):
    input_prefix: str = ""
    input_suffix: str = ""
