"""llama.cpp server request schemas (the fields with a meaning here) and their mapping
onto neutral SamplingParams."""

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import (
    MAX_CONSTRAINT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    Constraint,
    SamplingParams,
    sampling_params,
)
from app.text.stop import MAX_STOP_STRINGS, check_stop_strings
from deployments.api.prompts import MediaPrompt, prompt_object


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


# A prompt piece: text, or a token id. llama.cpp's `prompt` is one piece list, a list of
# them, or a list of prompts (see `prompts`).
PromptPiece = int | str
MAX_PROMPTS = 64


def _pieces(
    prompt: PromptPiece | list[PromptPiece] | dict[str, Any],
) -> list[PromptPiece | MediaPrompt]:
    if isinstance(prompt, dict):
        return [prompt_object(prompt, "prompt")]
    return [prompt] if isinstance(prompt, str | int) else list(prompt)


class LlamaCompletionRequest(BaseModel):
    """/completion's fields (llama.cpp's names and defaults)."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | dict[str, Any] | list[PromptPiece | list[PromptPiece] | dict[str, Any]] = ""
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
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)  # top alternatives per generated token
    post_sampling_probs: bool = False  # probabilities (0-1) rather than logprobs
    # [[token id or text, bias or false], ...] or {token id or text: bias or false}: text
    # biases every token of its encoding; false bans (llama.cpp's two forms).
    logit_bias: list[tuple[PromptPiece, float | bool]] | dict[str, float | bool] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    response_fields: list[str] | None = Field(None, max_length=64)  # "a/b": a nested field
    return_tokens: bool = False  # the generated token ids in `tokens`
    return_progress: bool = False  # a prompt_progress event before the first token
    timings_per_token: bool = False  # timings in every streamed event

    def prompts(self) -> list[list[PromptPiece | MediaPrompt]]:
        """The prompts, each as pieces, read as llama.cpp reads them: a string, a JSON
        prompt object (with media or not) or a flat list of ids and texts is one prompt;
        a list whose items are strings, objects or lists is several (each a string, ids,
        or ids mixed with texts)."""
        p = self.prompt
        if isinstance(p, str | dict):
            p = [p]
        elif all(isinstance(x, int | str) for x in p) and not all(isinstance(x, str) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if not p or len(p) > MAX_PROMPTS:
            raise InvalidRequestError(f"give 1 to {MAX_PROMPTS} prompts", "prompt")
        return [_pieces(x) for x in p]

    def bias_entries(self) -> list[tuple[PromptPiece, float]]:
        """(token id or text, bias) pairs; false is the strongest ban there is (-100)."""
        if self.logit_bias is None:
            return []
        items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        entries: list[tuple[PromptPiece, float]] = []
        for key, bias in items:
            if isinstance(key, str) and key.lstrip("-").isdigit():
                key = int(key)
            if bias is True:
                raise InvalidRequestError("a logit_bias is a number or false", "logit_bias")
            entries.append((key, -100.0 if bias is False else float(bias)))
        return entries

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

    def params(
        self, default_max_tokens: int, bias: dict[int, float] | None = None
    ) -> SamplingParams:
        """`bias`: `bias_entries` with texts encoded, by token id."""
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
            logprobs=self.n_probs or None,
            logit_bias=bias or {},
        )
        names = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}
        return sampling_params(fields, names)

    @property
    def stop_strings(self) -> list[str]:
        return check_stop_strings(self.stop, "stop")


class LlamaInfillRequest(LlamaCompletionRequest):
    prompt: str | list[int] = ""  # what follows the middle's start: text or token ids
    input_prefix: str = ""
    input_suffix: str = ""
