"""OpenAI's Vector Stores request bodies, as the official SDK sends them
(`client.vector_stores`, `.files`, `.file_batches`, `.search`)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI's default static chunking, and its bounds.
DEFAULT_CHUNKING = {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}
CHUNK_TOKENS = (100, 4096)
MAX_RESULTS = 50  # max_num_results' bound, as OpenAI's
MAX_FILES_A_CALL = 500  # file_ids in one create or batch, as OpenAI's


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Static(Body):
    max_chunk_size_tokens: int = Field(ge=CHUNK_TOKENS[0], le=CHUNK_TOKENS[1])
    chunk_overlap_tokens: int = Field(ge=0)

    @model_validator(mode="after")
    def _overlap(self) -> "Static":
        if self.chunk_overlap_tokens > self.max_chunk_size_tokens // 2:
            raise ValueError("chunk_overlap_tokens must be at most half of max_chunk_size_tokens")
        return self


class Chunking(Body):
    type: Literal["auto", "static"] = "auto"
    static: Static | None = None

    @model_validator(mode="after")
    def _static(self) -> "Chunking":
        if (self.type == "static") != (self.static is not None):
            raise ValueError("`static` is given exactly when type is 'static'")
        return self

    def settings(self) -> dict[str, int]:
        return self.static.model_dump() if self.static is not None else dict(DEFAULT_CHUNKING)


def chunking_of(strategy: Chunking | None) -> dict[str, int]:
    return strategy.settings() if strategy is not None else dict(DEFAULT_CHUNKING)


def _metadata(value: dict | None) -> dict | None:
    if value is None:
        return None
    if len(value) > 16:
        raise ValueError("metadata holds at most 16 pairs")
    for k, v in value.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise ValueError("metadata keys are at most 64 characters, values strings of 512")
    return value


def _attributes(value: dict | None) -> dict | None:
    if value is None:
        return None
    if len(value) > 16:
        raise ValueError("attributes hold at most 16 pairs")
    for k, v in value.items():
        if len(k) > 64 or not isinstance(v, str | int | float | bool):
            raise ValueError(
                "attribute keys are at most 64 characters; values strings, numbers or booleans"
            )
        if isinstance(v, str) and len(v) > 512:
            raise ValueError("attribute values are strings of at most 512 characters")
    return value


class ExpiresAfter(Body):
    anchor: Literal["last_active_at"] = "last_active_at"
    days: int = Field(ge=1, le=365)


class StoreCreate(Body):
    name: str | None = Field(None, max_length=256)
    file_ids: list[str] = Field(default_factory=list, max_length=MAX_FILES_A_CALL)
    chunking_strategy: Chunking | None = None
    expires_after: ExpiresAfter | None = None
    metadata: dict[str, Any] | None = None
    description: str | None = Field(None, max_length=512)

    _metadata = field_validator("metadata")(_metadata)


class StoreUpdate(Body):
    name: str | None = Field(None, max_length=256)
    expires_after: ExpiresAfter | None = None
    metadata: dict[str, Any] | None = None

    _metadata = field_validator("metadata")(_metadata)


class FileCreate(Body):
    file_id: str = Field(max_length=64)
    chunking_strategy: Chunking | None = None
    attributes: dict[str, Any] | None = None

    _attributes = field_validator("attributes")(_attributes)


class FileUpdate(Body):
    attributes: dict[str, Any] | None

    _attributes = field_validator("attributes")(_attributes)


class BatchCreate(Body):
    file_ids: list[str] | None = Field(None, max_length=MAX_FILES_A_CALL)
    files: list[FileCreate] | None = Field(None, max_length=MAX_FILES_A_CALL)
    chunking_strategy: Chunking | None = None
    attributes: dict[str, Any] | None = None

    _attributes = field_validator("attributes")(_attributes)

    @model_validator(mode="after")
    def _one_list(self) -> "BatchCreate":
        if (self.file_ids is None) == (self.files is None):
            raise ValueError("give exactly one of file_ids and files")
        return self

    def entries(self) -> list[FileCreate]:
        if self.files is not None:
            return self.files
        return [
            FileCreate(
                file_id=f, chunking_strategy=self.chunking_strategy, attributes=self.attributes
            )
            for f in self.file_ids or []
        ]


class RankingOptions(Body):
    ranker: Literal["auto", "default-2024-11-15", "none"] = "auto"
    score_threshold: float = Field(0.0, ge=0.0, le=1.0)


class SearchRequest(Body):
    query: str | list[str]
    max_num_results: int = Field(10, ge=1, le=MAX_RESULTS)
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None
    rewrite_query: bool = False

    def text(self) -> str:
        return self.query if isinstance(self.query, str) else " ".join(self.query)
